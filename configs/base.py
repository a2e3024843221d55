"""The TaCL paper's recipe (arXiv 2111.04198): continual pre-training of bert-base-uncased.

    huggingface-cli download bert-base-uncased --local-dir /path/bert-base-uncased
    python -m tacl_jax.main --config=configs/base.py --workdir=gs://BUCKET/tacl_base \
        --config.init.hf_path=/path/bert-base-uncased

Student and teacher start from bert-base-uncased; L = 256, global batch 256, 150k steps, AdamW lr
1e-4, no weight decay, 10% linear warm-up then linear decay, clip 1.0, τ = 0.01; MLM + TaCL, NSP
off (packed full-sentence sequences). The paper trained fp32 on 8×V100 for ~40 h; here the
default compute is ``model.dtype='auto'``: bf16 on TPUs/GPUs (f32 params, accumulation and
losses), f32 on CPUs without bf16 units (``--config.model.dtype=float32`` for the paper's numerics
everywhere).
Hardware: a TPU v4-8 or one 8×GPU host. Expected result (authors' README): SQuAD 1.1 EM/F1
80.8/88.5 → 81.6/89.0, GLUE average 79.6 → 81.2 after fine-tuning. The full recipe has not
been run with this code yet (the 100-step demo's numbers are in ``configs/demo.py``).
Throughput on such hardware: not yet measured.
"""

from tacl_jax.config import default_config


def get_config():
    c = default_config()
    c.init.hf_path = "bert-base-uncased"   # a local folder; see the command above
    c.max_len = 256
    c.global_batch_size = 256
    c.num_train_steps = 150_000
    c.optim.learning_rate = 1e-4
    c.optim.weight_decay = 0.0
    c.optim.warmup_fraction = 0.1
    c.optim.clip_norm = 1.0
    c.tacl.temperature = 0.01
    c.log_every = 100
    return c
