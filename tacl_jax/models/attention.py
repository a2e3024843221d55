"""Bidirectional scaled dot-product attention, laid out for fast batched matmuls.

Why heads-major: XLA lowers an einsum to a batched ``dot`` whose batch dimensions must lead. With
the projections' natural ``[B, L, heads, head_dim]`` layout the batch dims (b, h) are not leading,
so every attention matmul (forward and the four of the backward) gets a transpose fused into it and
runs far below the machine's matmul rate (6 GFLOP/s measured on a 2-core CPU for
``'bhqk,bkhd->bqhd'``). Transposing q, k and v once to ``[B, heads, L, head_dim]`` (cheap: the
size of the hidden states, not of the ``L × L`` scores) makes all six matmuls canonical.

The 1/√d scale is applied to q (``[B, L, H]`` elements) rather than to the scores (``L²`` per
head). Scores, softmax and the probabilities' dropout are in f32; the probability × value matmul
runs in the compute dtype with f32 accumulation.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array,
                          dropout: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """``q, k, v [B, L, heads, head_dim]`` (compute dtype), additive ``bias [B, 1, 1, L]`` (f32:
    0 to attend, very negative to mask a key) -> context ``[B, L, heads, head_dim]`` in q's dtype.

    ``dropout`` is applied to the attention probabilities (f32 ``[B, heads, L, L]``) when given.
    """
    dtype = q.dtype
    scale = jnp.asarray(1.0 / q.shape[-1] ** 0.5, jnp.float32)
    qh = (jnp.swapaxes(q, 1, 2).astype(jnp.float32) * scale).astype(dtype)   # [B, h, L, d]
    kh = jnp.swapaxes(k, 1, 2)
    vh = jnp.swapaxes(v, 1, 2)
    scores = jnp.einsum("bhqd,bhkd->bhqk", qh, kh, preferred_element_type=jnp.float32) + bias
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout is not None:
        probs = dropout(probs)
    ctx = jnp.einsum("bhqk,bhkd->bhqd", probs.astype(dtype), vh, preferred_element_type=jnp.float32)
    return jnp.swapaxes(ctx.astype(dtype), 1, 2)
