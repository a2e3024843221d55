"""TaCL's token-aware contrastive loss (arXiv 2111.04198, ``../shared/docs/method.md`` §1).

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
    hs = _normalize(student_hidden)
    ht = _normalize(jax.lax.stop_gradient(teacher_hidden))
    scores = jnp.einsum("bid,bjd->bij", hs, ht, preferred_element_type=jnp.float32) / temperature
    if key_mask is not None:
        scores = jnp.where(key_mask[:, None, :] > 0, scores, _NEG)
    logz = jax.nn.logsumexp(scores, axis=-1)
    positive = jnp.diagonal(scores, axis1=1, axis2=2)
    correct = (jnp.argmax(scores, axis=-1) == jnp.arange(scores.shape[1])[None]).astype(jnp.float32)
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
