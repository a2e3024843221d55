"""A tiny COCO-LM run on synthetic data: tests and a CPU smoke test.

    python -m tacl_jax.main --config=configs/coco_lm_tiny.py --workdir=/tmp/coco_tiny

Any CPU, about a minute (100 steps). Random ids, so nothing here is a language model: the
generator stays near uniform (gen_mlm_loss ≈ ln 512 ≈ 6.2, replaced_frac ≈ 1), the binary head
learns the share of original tokens (binary_acc → ≈ 0.85, binary_loss 0.69 → ≈ 0.43), the CLM loss
falls with its weight 1 − σ(z) (3.1 → ≈ 1.0), SCL stays near ln(2G − 1) = ln 7 ≈ 1.95 (negatives
within groups of G = 4 sequences). Measured: total 45.9 → 30.8. ``tests/test_coco_lm.py`` trains
on learnable sequences instead. ``configs/coco_lm_base.py``'s recipe on ``configs/tiny.py``'s run
(model, length, batch, steps, learning rate, fp32), with a 1-layer generator.
"""

import os

from tacl_jax.config import load_config_file


def get_config():
    here = os.path.dirname(os.path.abspath(__file__))
    # coco_lm_base.py's objective, masking (every selected token -> [MASK]) and optimizer (Adam
    # 0.9/0.98, eps 1e-6, weight decay 0.01, clip 2.0) ...
    c = load_config_file(os.path.join(here, "coco_lm_base.py"))
    # ... on tiny.py's run: its model, length, batch, steps, learning rate and precision.
    tiny = load_config_file(os.path.join(here, "tiny.py"))
    c.init.scratch = tiny.init.scratch
    for key in ("max_len", "global_batch_size", "num_train_steps", "log_every"):
        c[key] = tiny[key]
    c.optim.learning_rate, c.model.dtype = tiny.optim.learning_rate, tiny.model.dtype
    c.grad_accum_steps = 1
    c.optim.warmup_steps = -1            # 10% of the steps (optim.warmup_fraction)
    c.coco_lm.generator_layers = 1
    c.coco_lm.scl_group_size = 4         # 2 SCL negative groups per batch of 8 (the recipe's 16 > 8)
    return c
