"""Masked-language-model cross-entropy at the predicted positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mlm_per_position(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``logits [B, P, V]`` (any float dtype; computed in f32), ``targets [B, P]`` ->
    ``(nll [B, P], correct [B, P])`` with ``correct`` 1.0 where the target's logit is the largest.

    A fused softmax cross-entropy with a hand-written gradient, ``g · (softmax − onehot)`` in one
    pass over the ``[B, P, V]`` logits (autodiff of ``logsumexp`` + gather makes three, and the
    separate ``argmax`` a fourth). ``correct`` compares the target's logit with the maximum, so an
    exact tie counts as correct (``argmax`` would pick the first index).
    """
    return _xent(logits.astype(jnp.float32), targets.astype(jnp.int32))


def _xent_parts(logits, targets):
    top = jnp.max(logits, axis=-1)
    logz = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (logz - gold, (gold >= top).astype(jnp.float32)), logz


@jax.custom_vjp
def _xent(logits, targets):
    return _xent_parts(logits, targets)[0]


def _xent_fwd(logits, targets):
    out, logz = _xent_parts(logits, targets)
    return out, (logits, logz, targets)


def _xent_bwd(res, g):
    logits, logz, targets = res
    g_nll = g[0]   # ``correct`` is a step function: no gradient
    onehot = jnp.arange(logits.shape[-1], dtype=jnp.int32) == targets[..., None]
    d = (jnp.exp(logits - logz[..., None]) - onehot.astype(jnp.float32)) * g_nll[..., None]
    return d, np.zeros(targets.shape, jax.dtypes.float0)


_xent.defvjp(_xent_fwd, _xent_bwd)


def mlm_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy over the positions with ``weights [B, P]`` = 1, and the accuracy there.

    Returns ``(loss, accuracy)`` scalars; 0 when no position is weighted.
    """
    nll, correct = mlm_per_position(logits, targets)
    w = weights.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    return (nll * w).sum() / n, (correct * w).sum() / n
