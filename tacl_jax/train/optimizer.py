"""AdamW with linear warm-up then linear decay to 0, global-norm clipping, and no weight decay on
biases and LayerNorm parameters (as BERT and the original TaCL code)."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(peak: float, total_steps: int, warmup_steps: int) -> optax.Schedule:
    """0 → ``peak`` linearly over ``warmup_steps``, then linearly to 0 at ``total_steps``."""
    warmup_steps = max(0, min(warmup_steps, total_steps))
    decay = optax.linear_schedule(peak, 0.0, max(1, total_steps - warmup_steps))
    if warmup_steps == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), decay], [warmup_steps])


def decay_mask(params):
    """True for matrices (kernels, embeddings), False for biases and LayerNorm scales/biases."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def warmup_steps(optim_cfg, total_steps: int) -> int:
    if optim_cfg.warmup_steps >= 0:
        return int(optim_cfg.warmup_steps)
    return int(round(optim_cfg.warmup_fraction * total_steps))


def make_optimizer(optim_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``optim_cfg`` = ``config.optim`` (learning_rate, warmup_steps (-1: use warmup_fraction),
    warmup_fraction, weight_decay, b1, b2, eps, clip_norm (0: off))."""
    schedule = learning_rate_schedule(optim_cfg.learning_rate, total_steps, warmup_steps(optim_cfg, total_steps))
    chain = []
    if optim_cfg.clip_norm > 0:
        chain.append(optax.clip_by_global_norm(optim_cfg.clip_norm))
    chain.append(optax.adamw(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                             weight_decay=optim_cfg.weight_decay, mask=decay_mask))
    return optax.chain(*chain), schedule
