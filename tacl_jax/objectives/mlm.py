"""Masked-language-model cross-entropy at the predicted positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mlm_per_position(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``logits [B, P, V]`` (any float dtype; computed in f32), ``targets [B, P]`` ->
    ``(nll [B, P], correct [B, P])`` with ``correct`` 1.0 where the argmax is the target."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return logz - gold, correct


def mlm_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy over the positions with ``weights [B, P]`` = 1, and the accuracy there.

    Returns ``(loss, accuracy)`` scalars; 0 when no position is weighted.
    """
    nll, correct = mlm_per_position(logits, targets)
    w = weights.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    return (nll * w).sum() / n, (correct * w).sum() / n
