"""Bidirectional scaled dot-product attention, laid out for fast batched matmuls.

Heads-major: XLA lowers an einsum to a batched ``dot`` whose batch dimensions must lead, so q, k
and v are transposed once to ``[B, heads, L, head_dim]`` (cheap: the size of the hidden states,
not of the ``L × L`` scores) and all six attention matmuls (forward and the four of the backward)
are canonical. The 1/√d scale is applied to q (``[B, L, H]`` elements) rather than to the scores
(``L²`` per head). Scores and softmax are in f32; the probability × value matmul runs in the
compute dtype with f32 accumulation.

**kernels='xla'** (TPU, GPU): the softmax (f32 inside) returns the probabilities in the compute
dtype, dropout acts on them there, and a hand-written backward keeps only those probabilities
(autodiff kept the f32 scores, which XLA:TPU re-read in extra ``[B, heads, L, L]`` f32 passes).

**bf16 on XLA:CPU** (``kernels='cpu'``, bf16, a CPU with bf16 matmul units; the same rule as
``tacl_jax.models.layers``' transposed copies): XLA:CPU runs a batched bf16 dot as such only in the
canonical form ``[.., M, K] · [.., K, N]``, and after folding the heads transposes into the dots
it upcast all six attention matmuls to f32. So on that path the heads transposes and every
transposed operand are materialised copies XLA does not fold (``layers._transposed_copy``'s
construction), and the two matmuls carry hand-written backward passes (``jax.custom_vjp``) made of
canonical dots, with the cotangent cast to bf16 (f32 accumulation kept). ``aᵀ·b`` copies the
cheaper way: ``copy(aᵀ)·b`` or ``copy((copy(bᵀ)·a)ᵀ)`` (the latter for ``pᵀ·g`` and ``gᵀ·q`` once
L > 2·head_dim).

Measurements: docs/performance.md#attention.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from tacl_jax.models import layers

# [B, h, M, K] x [B, h, K, N] -> [B, h, M, N]: the one dot form XLA:CPU runs in bf16 (module doc).
_CANONICAL = (((3,), (2,)), ((0, 1), (0, 1)))


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array,
                          dropout: Callable[[jax.Array], jax.Array] | None = None,
                          kernels: str = "xla") -> jax.Array:
    """``q, k, v [B, L, heads, head_dim]`` (compute dtype), additive ``bias [B, 1, 1, L]`` (f32:
    0 to attend, very negative to mask a key) -> context ``[B, L, heads, head_dim]`` in q's dtype.

    ``dropout`` is applied to the attention probabilities ``[B, heads, L, L]`` when given (f32
    with ``kernels='cpu'``; in the compute dtype with 'xla', see the module doc).
    ``kernels='cpu'``: XLA:CPU's canonical-copy forms in bf16 (module doc); 'xla': plain einsums.
    """
    dtype = q.dtype
    if kernels == "xla":
        return _xla_attention(q, k, v, bias, dropout)
    copies = _use_canonical_copies(q, kernels)
    swap = _swap_heads_copy if copies else (lambda x: jnp.swapaxes(x, 1, 2))
    scale = jnp.asarray(1.0 / q.shape[-1] ** 0.5, jnp.float32)
    qh = swap((q.astype(jnp.float32) * scale).astype(dtype))   # [B, h, L, d]
    kh, vh = swap(k), swap(v)
    if copies:
        scores = _product_for(jnp.dtype(dtype).name, True)(qh, kh) + bias
    else:
        scores = jnp.einsum("bhqd,bhkd->bhqk", qh, kh, preferred_element_type=jnp.float32) + bias
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout is not None:
        probs = dropout(probs)
    if copies:
        ctx = _product_for(jnp.dtype(dtype).name, False)(probs.astype(dtype), vh)
    else:
        ctx = jnp.einsum("bhqk,bhkd->bhqd", probs.astype(dtype), vh, preferred_element_type=jnp.float32)
    return swap(ctx.astype(dtype))


def _xla_attention(q, k, v, bias, dropout):
    """``kernels='xla'``: the probabilities leave the softmax in the compute dtype, which is also
    what its backward keeps (``_softmax_to``); dropout then acts on them in that dtype."""
    dtype = q.dtype
    swap = lambda x: jnp.swapaxes(x, 1, 2)   # noqa: E731
    scale = jnp.asarray(1.0 / q.shape[-1] ** 0.5, jnp.float32)
    qh = swap((q.astype(jnp.float32) * scale).astype(dtype))   # [B, h, L, d]
    kh, vh = swap(k), swap(v)
    scores = jnp.einsum("bhqd,bhkd->bhqk", qh, kh, preferred_element_type=jnp.float32) + bias
    probs = _softmax_to(jnp.dtype(dtype).name)(scores)          # [B, h, L, L] in dtype
    if dropout is not None:
        probs = dropout(probs)
    ctx = jnp.einsum("bhqk,bhkd->bhqd", probs, vh, preferred_element_type=jnp.float32)
    return swap(ctx.astype(dtype))


@functools.lru_cache(maxsize=None)
def _softmax_to(dtype_name: str):
    """``softmax(s [..., N], axis=-1)`` computed in f32, returned in ``dtype_name``; the backward
    keeps that output as its residual (not autodiff's f32 scores and probabilities) and returns
    the f32 cotangent ``p · (g - Σ p·g)``, computed in f32 from it."""
    dt = jnp.dtype(dtype_name)

    @jax.custom_vjp
    def softmax(s):
        return jax.nn.softmax(s, axis=-1).astype(dt)

    def fwd(s):
        p = softmax(s)
        return p, p

    def bwd(p, g):
        pf, gf = p.astype(jnp.float32), g.astype(jnp.float32)
        return (pf * (gf - jnp.sum(pf * gf, axis=-1, keepdims=True)),)

    softmax.defvjp(fwd, bwd)
    return softmax


def _use_canonical_copies(q: jax.Array, kernels: str) -> bool:
    """bf16 on XLA:CPU with bf16 matmul units (module doc); an even head_dim for the copies."""
    return (q.dtype == jnp.bfloat16 and q.shape[-1] % 2 == 0 and kernels == "cpu"
            and layers._use_transposed_copy())


def _swap_heads_copy(x: jax.Array) -> jax.Array:
    """``[B, L, h, d] <-> [B, h, L, d]`` (axes 1 and 2 swapped; even d) as a materialised array:
    a transpose of ``[B, L, h, 2, d/2]`` that XLA does not fold into the consumer dot."""
    b, n1, n2, d = x.shape
    with jax.named_scope(layers.CPU_KERNEL_SCOPE):
        return x.reshape(b, n1, n2, 2, d // 2).transpose(0, 2, 1, 3, 4).reshape(b, n2, n1, d)


def _bmm(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [B, h, M, K] · b [B, h, K, N] -> [B, h, M, N]`` (f32 accumulation)."""
    return jax.lax.dot_general(a, b, _CANONICAL, preferred_element_type=jnp.float32)


def _bmm_nt(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """``a · bᵀ``: ``a [B, h, M, K], b [B, h, N, K] -> [B, h, M, N]`` in ``out_dtype``, as
    ``a · copy(bᵀ)``. (Here b is always ``[L, head_dim]``-sized, k or v: the cheaper copy.)"""
    return _bmm(a, layers._transposed_copy(b)).astype(out_dtype)


def _bmm_tn(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """``aᵀ · b``: ``a [B, h, K, M], b [B, h, K, N] -> [B, h, M, N]`` in ``out_dtype``, through the
    cheaper copy: ``copy(aᵀ) · b`` or ``copy((copy(bᵀ) · a)ᵀ)``."""
    k, m = a.shape[-2:]
    n = b.shape[-1]
    if k * m <= k * n + m * n:
        return _bmm(layers._transposed_copy(a), b).astype(out_dtype)
    return layers._transposed_copy(_bmm(layers._transposed_copy(b), a).astype(out_dtype))


@functools.lru_cache(maxsize=None)
def _product_for(dtype_name: str, rhs_transposed: bool):
    """The two attention matmuls with canonical dots both ways, f32 results:
    ``rhs_transposed=True``: ``q [B, h, Lq, d] · k [B, h, Lk, d]ᵀ -> scores [B, h, Lq, Lk]``;
    ``False``: ``p [B, h, Lq, Lk] · v [B, h, Lk, d] -> context [B, h, Lq, d]``."""
    dt = jnp.dtype(dtype_name)

    def forward(a, b):
        return _bmm_nt(a, b, jnp.float32) if rhs_transposed else _bmm(a, b)

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)

    def fwd(a, b):
        return forward(a, b), (a, b)

    def bwd(res, g):
        a, b = res
        g = g.astype(dt)
        if rhs_transposed:   # y = a·bᵀ: da = g·b, db = gᵀ·a
            return _bmm(g, b).astype(a.dtype), _bmm_tn(g, a, b.dtype)
        return _bmm_nt(g, b, a.dtype), _bmm_tn(a, g, b.dtype)   # y = a·b: da = g·bᵀ, db = aᵀ·g

    product.defvjp(fwd, bwd)
    return product

