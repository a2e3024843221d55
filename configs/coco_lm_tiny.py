"""A tiny COCO-LM run on synthetic data: tests and a CPU smoke test.

    python -m tacl_jax.main --config=configs/coco_lm_tiny.py --workdir=/tmp/coco_tiny

Any CPU, about a minute (100 steps). Random ids, so nothing here is a language model: the
generator stays near uniform (gen_mlm_loss ≈ ln 512 ≈ 6.2, replaced_frac ≈ 1), the binary head
learns the share of original tokens (binary_acc → ≈ 0.85, binary_loss 0.69 → ≈ 0.43), the CLM loss
falls with its weight 1 − σ(z) (3.1 → ≈ 1.0), SCL stays near ln(2G − 1) = ln 7 ≈ 1.95 (negatives
within groups of G = 4 sequences). Measured: total 45.9 → 30.8. ``tests/test_coco_lm.py`` trains
on learnable sequences instead.
"""

from tacl_jax.config import default_config
from tacl_jax.objectives.coco_lm import coco_lm_config


def get_config():
    c = default_config()
    c.objective = "coco_lm"
    c.coco_lm = coco_lm_config()
    c.coco_lm.generator_layers = 1
    c.coco_lm.scl_group_size = 4         # 2 SCL negative groups per batch of 8 (the recipe's 16 > 8)
    c.init.scratch.update(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64)
    c.masking.replace_prob = 1.0         # COCO-LM: every selected token → [MASK]
    c.masking.random_prob = 0.0
    c.max_len = 32
    c.global_batch_size = 8
    c.num_train_steps = 100
    c.log_every = 10
    c.optim.learning_rate = 1e-3
    c.optim.b2 = 0.98
    c.optim.eps = 1e-6
    c.optim.weight_decay = 0.01
    c.optim.clip_norm = 2.0
    c.model.dtype = "float32"
    return c
