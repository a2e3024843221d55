"""TaCL's token-aware contrastive loss (arXiv 2111.04198; as the authors' code computes it, github
yxuansu/TaCL ``pretraining/bert_contrastive.py``).

For each selected anchor position i of sequence b, the positive is the frozen teacher's state at
the same position, the negatives are the teacher's states at the other positions of the *same*
sequence: ``l[b,i] = -log softmax_j(<ĥs[b,i], ĥt[b,j]> / τ)[i]`` with L2-normalised final-layer
states and no projection head. Computed in f32 whatever the model's compute dtype: at τ = 0.01 a
bf16 cosine error of 4e-3 would move a logit by 0.4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e9  # finite, so a fully masked row cannot produce NaN


def _normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-24))


def token_contrastive_per_token(student_hidden: jax.Array, teacher_hidden: jax.Array,
                                key_mask: jax.Array | None, temperature: float
                                ) -> tuple[jax.Array, jax.Array]:
    """``student_hidden [B, L, H]``, ``teacher_hidden [B, L, H]``, ``key_mask [B, L]`` or None ->
    ``(nll [B, L], correct [B, L])`` for every position as an anchor.

    ``key_mask=None`` keeps every key position in the softmax (the original, which pads to a fixed
    length and keeps [PAD] keys); an array excludes keys where it is 0.
    """
    b, length = student_hidden.shape[:2]
    every = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    return token_contrastive_at(student_hidden, teacher_hidden, every, key_mask, temperature)


def token_contrastive_at(student_anchors: jax.Array, teacher_hidden: jax.Array, positions: jax.Array,
                         key_mask: jax.Array | None, temperature: float) -> tuple[jax.Array, jax.Array]:
    """The loss of the anchors at ``positions [B, P]`` only: ``student_anchors [B, P, H]`` (the
    student's states there), ``teacher_hidden [B, L, H]`` (every position: the keys),
    ``key_mask [B, L]`` or None -> ``(nll [B, P], correct [B, P])``. The positive of slot p is
    the teacher's state at ``positions[b, p]``. Scores are ``[B, P, L]``, not ``[B, L, L]``."""
    hs = _normalize(student_anchors)
    ht = _normalize(jax.lax.stop_gradient(teacher_hidden))
    scores = jnp.einsum("bpd,bjd->bpj", hs, ht, preferred_element_type=jnp.float32) / temperature
    if key_mask is not None:
        scores = jnp.where(key_mask[:, None, :] > 0, scores, _NEG)
    logz = jax.nn.logsumexp(scores, axis=-1)
    positions = positions.astype(jnp.int32)
    positive = jnp.take_along_axis(scores, positions[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(scores, axis=-1) == positions).astype(jnp.float32)
    return logz - positive, correct


def token_contrastive_loss(student_hidden: jax.Array, teacher_hidden: jax.Array, selected: jax.Array,
                           key_mask: jax.Array | None = None, temperature: float = 0.01
                           ) -> tuple[jax.Array, jax.Array]:
    """Mean TaCL loss over the anchors with ``selected [B, L]`` = 1 in the whole batch, and
    ``tacl_acc``: the share of those anchors whose most similar teacher state is their own.

    Returns ``(loss, accuracy)`` scalars.
    """
    nll, correct = token_contrastive_per_token(student_hidden, teacher_hidden, key_mask, temperature)
    m = selected.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    return (nll * m).sum() / n, (correct * m).sum() / n
