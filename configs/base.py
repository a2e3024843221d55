"""TaCL (arXiv 2111.04198), the recommended run: the paper's recipe with this code's clean defaults.

    python -m tacl_jax.main --config=configs/base.py --workdir=gs://BUCKET/tacl_base

Student and teacher start from bert-base-uncased; L = 256, global batch 256, 150k steps, AdamW lr
1e-4, eps 1e-6, no weight decay, 10% linear warm-up then linear decay, clip 1.0, τ = 0.01: the
paper's and the authors' code's numbers. Where the authors' code has a quirk this config takes the
clean choice: MLM + TaCL on packed full-sentence rows (theirs: BERT sentence pairs with NSP), a
deterministic teacher (theirs: dropout on, a bug), [PAD] keys masked out of the contrastive softmax
(theirs: kept), BERT's whole-word budget should ``masking.whole_word`` be set (``masking.budget``).
``configs/paper.py`` sets the authors' choices and lists what still differs. Compute:
``model.dtype='auto'``: bf16 on TPUs/GPUs (f32 params, accumulation and losses), f32 on CPUs
without bf16 units (the paper trained fp32 on 8×V100 for ~40 h).
Hardware: a TPU v4-8 or one 8×GPU host (presets ``tpu_v4_8.py``, ``tpu_v5e_16.py``,
``gpu_8xh100.py`` build on this file). The authors' result (their README; their run is what
``paper.py`` reproduces): SQuAD 1.1 EM/F1 80.8/88.5 → 81.6/89.0, GLUE average 79.6 → 81.2 after
fine-tuning. Neither recipe has been run in full with this code yet (the demo's output is in
README.md). Throughput on such hardware: not yet measured.
"""

from tacl_jax.config import default_config


def get_config():
    c = default_config()
    c.init.hf_path = "bert-base-uncased"   # a Hub id (the Hugging Face cache) or a local folder
    c.max_len = 256
    c.global_batch_size = 256
    c.num_train_steps = 150_000
    c.optim.learning_rate = 1e-4
    c.optim.weight_decay = 0.0
    c.optim.eps = 1e-6                    # transformers' AdamW default, which the authors used
    c.optim.warmup_fraction = 0.1
    c.optim.clip_norm = 1.0
    c.tacl.temperature = 0.01
    c.log_every = 100
    return c
