"""AdamW with linear warm-up then linear decay to 0, global-norm clipping, and no weight decay on
biases and LayerNorm parameters (as BERT and the original TaCL code).

``optim.fused`` (default True) computes optax's update in one elementwise expression per
parameter (``fused_adamw``) with the clip as a scalar factor: with optax's
``select(‖g‖ < c, g, (g / ‖g‖)·c)`` XLA:CPU writes the clipped gradient tree out and reads it back
in the moments' loops (one more write and two more reads of every gradient per step). Both keep the
same optimizer state, so a checkpoint resumes under either.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
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


def optax_adamw(schedule: optax.Schedule, *, b1: float, b2: float, eps: float, weight_decay: float,
                clip_norm: float, mask: Callable = decay_mask) -> optax.GradientTransformation:
    """optax's chain: ``clip_by_global_norm`` (when ``clip_norm > 0``), then ``adamw``."""
    chain = [optax.clip_by_global_norm(clip_norm)] if clip_norm > 0 else []
    chain.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask))
    return optax.chain(*chain)


def _node(state, cls):
    """The one ``cls`` node of an optax state tree (found by its NamedTuple name)."""
    node = optax.tree_utils.tree_get(state, cls.__name__)
    if not isinstance(node, cls):
        raise ValueError(f"fused_adamw: no {cls.__name__} in the optimizer state; it takes the state of its own init")
    return node


def fused_adamw(schedule: optax.Schedule, *, b1: float, b2: float, eps: float, weight_decay: float,
                clip_norm: float, mask: Callable = decay_mask) -> optax.GradientTransformation:
    """``optax_adamw``'s update as one elementwise expression per parameter, in optax's order of
    operations but for the clip (a scalar factor, see below; results agree to float rounding),
    with ``optax_adamw``'s state (its ``init``; the update reads and replaces the
    ``ScaleByAdamState`` and the schedule's ``ScaleByScheduleState``), so either resumes the other.
    The global gradient norm is the only pass over every gradient before it."""
    reference = optax_adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, clip_norm=clip_norm,
                            mask=mask)

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("fused_adamw needs the params (weight decay): tx.update(grads, state, params)")
        adam, sched = _node(state, optax.ScaleByAdamState), _node(state, optax.ScaleByScheduleState)
        count = optax.safe_increment(adam.count)
        c1, c2 = 1 - b1 ** count, 1 - b2 ** count            # f32 scalars, as optax's bias correction
        step_size = -schedule(sched.count)
        if clip_norm > 0:
            # optax.clip_by_global_norm's (g / ‖g‖)·clip as one scalar factor: XLA then scales g
            # inside each consumer instead of writing the clipped tree out (one rounding apart).
            g_norm = optax.tree.norm(grads)
            clip = jnp.where(g_norm < clip_norm, 1.0, clip_norm / g_norm)
        else:
            clip = None

        def leaf(g, m, v, p, decays):
            if clip is not None:
                g = g * clip.astype(g.dtype)
            m = (1 - b1) * g + b1 * m
            v = (1 - b2) * (g ** 2) + b2 * v
            u = (m / c1.astype(m.dtype)) / (jnp.sqrt(v / c2.astype(v.dtype)) + eps)
            if decays:
                u = u + weight_decay * p
            return jnp.array(step_size, dtype=u.dtype) * u, m, v

        treedef = jax.tree.structure(params)
        parts = [treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu, params, mask(params))]
        out = [leaf(*xs) for xs in zip(*parts)]
        updates, mu, nu = (treedef.unflatten([o[i] for o in out]) for i in range(3))
        return updates, optax.tree_utils.tree_set(
            state, ScaleByAdamState=optax.ScaleByAdamState(count=count, mu=mu, nu=nu),
            ScaleByScheduleState=optax.ScaleByScheduleState(count=optax.safe_increment(sched.count)))

    return optax.GradientTransformation(reference.init, update)


def make_optimizer(optim_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``optim_cfg`` = ``config.optim`` (learning_rate, warmup_steps (-1: use warmup_fraction),
    warmup_fraction, weight_decay, b1, b2, eps, clip_norm (0: off), fused (default True:
    ``fused_adamw``; False: ``optax_adamw``; same update and state))."""
    schedule = learning_rate_schedule(optim_cfg.learning_rate, total_steps, warmup_steps(optim_cfg, total_steps))
    build = fused_adamw if optim_cfg.get("fused", True) else optax_adamw
    return build(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay,
                 clip_norm=optim_cfg.clip_norm), schedule
