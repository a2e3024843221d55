"""A tiny COCO-LM run on synthetic data: tests and a CPU smoke test.

    python -m tacl_jax.main --config=configs/coco_lm_tiny.py --workdir=/tmp/coco_tiny

Any CPU, about a minute (100 steps). Random ids, so nothing here is a language model: the
generator stays near uniform (gen_mlm_loss ≈ ln 512 ≈ 6.2, replaced_frac ≈ 1), the binary head
learns the share of original tokens (binary_acc → ≈ 0.85, binary_loss 0.69 → ≈ 0.43), the CLM loss
falls with its weight 1 − σ(z) (3.1 → ≈ 1.0), SCL stays near ln(2G − 1) = ln 7 ≈ 1.95 (negatives
within groups of G = 4 sequences). Measured: total 45.9 → 30.8. ``tests/test_coco_lm.py`` trains
on learnable sequences instead. Builds on ``configs/coco_lm_base.py`` (the recipe) and sets only what
a tiny CPU run changes (sizes, length, learning rate, precision).
"""

import os

from tacl_jax.config import load_config_file


def get_config():
    # coco_lm_base.py's objective, masking (every selected token -> [MASK]) and optimizer (Adam
    # 0.9/0.98, eps 1e-6, weight decay 0.01, clip 2.0) at a tiny size:
    c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "coco_lm_base.py"))
    c.coco_lm.generator_layers = 1
    c.coco_lm.scl_group_size = 4         # 2 SCL negative groups per batch of 8 (the recipe's 16 > 8)
    c.init.scratch.update(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64)
    c.max_len = 32
    c.global_batch_size = 8
    c.grad_accum_steps = 1
    c.num_train_steps = 100
    c.log_every = 10
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = -1            # 10% of the steps (optim.warmup_fraction)
    c.model.dtype = "float32"
    return c
