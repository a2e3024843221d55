"""Building blocks for the BERT model: a dense layer with logical axis names, the tied MLM decoder,
and the matmuls under both, with hand-written backward passes (``jax.custom_vjp``).

``kernels`` (``BertConfig.kernels``, decided once from the platform of the run's devices by
``tacl_jax.precision.kernels_for``): 'xla' (TPU, GPU) writes plain dots and reductions; 'cpu' adds
the XLA:CPU-only forms below. A TPU or GPU program never contains the latter, whatever host
compiles it.

Why custom backward passes:

* **Backward matmuls in the compute dtype.** With bf16 inputs and an f32 result
  (``preferred_element_type``) plain autodiff produces f32 cotangents, so the two backward matmuls
  (2/3 of the FLOPs) would run in f32. The cotangent is cast to the compute dtype first, keeping
  f32 accumulation. In fp32 mode these are ordinary matmuls.
* **No transposed copies of the weights.** ``dx = g · Wᵀ``, ``dW = xᵀ · g`` and the tied decoder's
  ``h · Eᵀ`` are ``dot_general`` contractions over the right dimensions.
* **Bias gradients as matmuls** (``kernels='cpu'``): ``ones[M] · g[M, N]`` instead of a
  ``reduce_sum`` over the rows, which XLA:CPU runs far slower.
* **bf16 weight gradients on XLA:CPU** (``_rows_dot``, ``kernels='cpu'``, bf16, by default only on
  CPUs with bf16 matmul units): XLA:CPU runs a bf16 dot as such only when its left operand is
  contracted over its last dimension and upcasts ``dW = xᵀ · g`` to f32. A transposed copy
  ``xᵀ [K, M]`` built as one 3-d transpose ``[M, 2, K/2] -> [2, K/2, M]`` (a plain ``x.T``, even
  behind an ``optimization_barrier``, is folded back into the dot) makes it a canonical bf16 dot.
  ``CPU_BF16_TRANSPOSED_COPY`` = True / False forces it on / off.

Measurements (``bench/step_throughput.py --ablate``):
docs/performance.md#bf16-weight-gradients-on-xlacpu-transposed-copies and
docs/performance.md#bias-gradients-the-optimizer-and-the-rest.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Initializer = nn.initializers.Initializer

_NT = (((1,), (1,)), ((), ()))   # [M, K] x [N, K] -> [M, N]
_TN = (((0,), (0,)), ((), ()))   # [M, K] x [M, N] -> [K, N]


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


# The name scope of every XLA:CPU-only construction: it stays in the compiled HLO's metadata, so
# ``tacl_jax.aot`` can say whether a program contains one (a TPU/GPU program must not).
CPU_KERNEL_SCOPE = "tacl_cpu_kernel"

# See the module doc; read at trace time (the bench's ablation flips it before building a step).
# None = where the CPU has bf16 matmul units (tacl_jax.precision), True / False = always / never.
CPU_BF16_TRANSPOSED_COPY: bool | None = None


KERNELS = ("xla", "cpu")


def _use_transposed_copy() -> bool:
    """With ``kernels='cpu'``: whether bf16 row contractions take the transposed copy (module doc)."""
    if CPU_BF16_TRANSPOSED_COPY is not None:
        return CPU_BF16_TRANSPOSED_COPY
    from tacl_jax import precision

    return precision.auto_compute_dtype("cpu", precision.cpu_flags()) == "bfloat16"


def _transposed_copy(a: jax.Array) -> jax.Array:
    """``a [..., M, K] -> [..., K, M]`` (the last two axes swapped) as a materialised array that XLA
    does not fold into a consumer dot (see the module doc): one transpose ``[..., M, 2, K/2] ->
    [..., 2, K/2, M]``; for an odd K the slower concatenation of the transposes of a's two column
    halves."""
    *lead, m, k = a.shape
    n = len(lead)
    with jax.named_scope(CPU_KERNEL_SCOPE):
        if k % 2 == 0:
            return a.reshape(*lead, m, 2, k // 2).transpose(*range(n), n + 1, n + 2, n).reshape(*lead, k, m)
        half = k // 2
        return jax.lax.concatenate([jnp.swapaxes(a[..., :half], -1, -2), jnp.swapaxes(a[..., half:], -1, -2)], n)


def _rows_dot(a: jax.Array, b: jax.Array, kernels: str) -> jax.Array:
    """``aᵀ · b``: ``a [M, K], b [M, N] -> [K, N]`` (f32), contracting the rows of both.

    In bf16 with ``kernels='cpu'`` through a transposed copy of ``a`` (a canonical dot XLA:CPU runs in
    bf16; see the module doc), elsewhere as one ``dot_general``. The copy is skipped where YNNPACK
    would not take the dot anyway (a vector or a tiny matrix), so XLA's f32 fallback stays valid.
    """
    m, k = a.shape
    n = b.shape[1]
    if (a.dtype == b.dtype == jnp.bfloat16 and k >= 2 and min(m, n) > 1 and max(m, k, n) >= 8
            and kernels == "cpu" and _use_transposed_copy()):
        return _dot(_transposed_copy(a), b)
    return _dot(a, b, _TN)


def _row_sum(g: jax.Array, kernels: str) -> jax.Array:
    """``g [M, N] -> [N]`` (f32): with ``kernels='cpu'`` as a matmul with a ones vector (see the
    module doc), else XLA's reduction."""
    if kernels == "cpu":
        with jax.named_scope(CPU_KERNEL_SCOPE):
            return _dot(jnp.ones((g.shape[0],), g.dtype), g, _TN)
    return jnp.sum(g.astype(jnp.float32), axis=0)


def matmul(x: jax.Array, w: jax.Array, compute_dtype, bias: jax.Array | None = None,
           kernels: str = "xla") -> jax.Array:
    """``x [M, K] @ w [K, N] (+ bias [N]) -> [M, N]`` in ``compute_dtype`` with f32 accumulation.

    Returns f32 (the accumulator); the caller casts. Both operands are cast to ``compute_dtype``;
    the bias is added in f32. ``kernels``: 'cpu' for XLA:CPU's forms (module doc), 'xla' (TPU,
    GPU) for plain dots and reductions.
    """
    if bias is None:
        return _matmul_for(jnp.dtype(compute_dtype).name, kernels)(x, w)
    return _matmul_bias_for(jnp.dtype(compute_dtype).name, kernels)(x, w, bias)


def _mm_bwd(dt, xc, wc, g, kernels):
    gc = g.astype(dt)
    return _dot(gc, wc, _NT), _rows_dot(xc, gc, kernels)


@functools.lru_cache(maxsize=None)
def _matmul_for(dtype_name: str, kernels: str):
    dt = jnp.dtype(dtype_name)

    @jax.custom_vjp
    def mm(x, w):
        return _dot(x.astype(dt), w.astype(dt))

    def fwd(x, w):
        xc, wc = x.astype(dt), w.astype(dt)
        # Residuals are kept in the compute dtype: half the memory of f32 in bf16 mode.
        return _dot(xc, wc), (xc, wc, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))

    def bwd(res, g):
        xc, wc, x_like, w_like = res
        dx, dw = _mm_bwd(dt, xc, wc, g, kernels)
        return dx.astype(x_like.dtype), dw.astype(w_like.dtype)

    mm.defvjp(fwd, bwd)
    return mm


@functools.lru_cache(maxsize=None)
def _matmul_bias_for(dtype_name: str, kernels: str):
    dt = jnp.dtype(dtype_name)

    @jax.custom_vjp
    def mm(x, w, b):
        return _dot(x.astype(dt), w.astype(dt)) + b.astype(jnp.float32)

    def fwd(x, w, b):
        xc, wc = x.astype(dt), w.astype(dt)
        return (_dot(xc, wc) + b.astype(jnp.float32),
                (xc, wc, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype), jnp.zeros((), b.dtype)))

    def bwd(res, g):
        xc, wc, x_like, w_like, b_like = res
        dx, dw = _mm_bwd(dt, xc, wc, g, kernels)
        return dx.astype(x_like.dtype), dw.astype(w_like.dtype), _row_sum(g, kernels).astype(b_like.dtype)

    mm.defvjp(fwd, bwd)
    return mm


def tied_decoder(h: jax.Array, table: jax.Array, bias: jax.Array, compute_dtype, kernels: str = "xla") -> jax.Array:
    """The MLM decoder tied to the word embeddings: ``h [M, H] · table [V, H]ᵀ + bias [V] -> [M, V]``
    (f32), without materialising ``tableᵀ``; gradients for all three (``d table = gᵀ · h``)."""
    return _decoder_for(jnp.dtype(compute_dtype).name, kernels)(h, table, bias)


@functools.lru_cache(maxsize=None)
def _decoder_for(dtype_name: str, kernels: str):
    dt = jnp.dtype(dtype_name)

    @jax.custom_vjp
    def dec(h, table, bias):
        return _dot(h.astype(dt), table.astype(dt), _NT) + bias.astype(jnp.float32)

    def fwd(h, table, bias):
        hc, tc = h.astype(dt), table.astype(dt)
        return (_dot(hc, tc, _NT) + bias.astype(jnp.float32),
                (hc, tc, jnp.zeros((), h.dtype), jnp.zeros((), table.dtype), jnp.zeros((), bias.dtype)))

    def bwd(res, g):
        hc, tc, h_like, t_like, b_like = res
        gc = g.astype(dt)
        dh = _dot(gc, tc)                  # [M, V] x [V, H]
        dt_ = _rows_dot(gc, hc, kernels)   # [M, V]ᵀ · [M, H] -> [V, H]
        return dh.astype(h_like.dtype), dt_.astype(t_like.dtype), _row_sum(g, kernels).astype(b_like.dtype)

    dec.defvjp(fwd, bwd)
    return dec


def _dense_nd(x: jax.Array, w: jax.Array, n_in: int, compute_dtype) -> jax.Array:
    """``kernels='xla'``: ``x [..., *in]`` contracted with ``w [*in, *out]`` -> f32 ``[..., *out]``,
    both operands in ``compute_dtype``, as one ``dot_general`` on the unreshaped arrays (autodiff's
    backward). Reshaping to ``[M, K] @ [K, N]`` (``matmul``) pins the ``[B, L, heads, head_dim]``
    result to the 2-d row-major layout, and XLA:TPU then re-laid out q, k, v, the context and
    their cotangents for the attention's batched matmuls: two copies each, 16 per layer forward +
    backward (bert-base layer, v4, 64 rows of 256: est. 10.89 -> 8.17 ms, relayouts 403 MB -> 0)."""
    dt = jnp.dtype(compute_dtype)
    dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
    return jax.lax.dot_general(x.astype(dt), w.astype(dt), dims, preferred_element_type=jnp.float32)


class Dense(nn.Module):
    """``y = x · W + b`` contracting the last ``len(in_features)`` axes of x with W's first axes.

    ``W`` has shape ``(*in_features, *out_features)``; its logical axis names are ``kernel_axes``
    (one name per dimension) and the bias's are the names of the output dimensions. Shapes:
    ``x [..., *in_features] -> y [..., *out_features]``, in ``dtype``.
    """

    in_features: Sequence[int]
    out_features: Sequence[int]
    kernel_axes: Sequence[str | None]
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernel_init: Initializer = nn.initializers.normal(0.02)
    kernels: str = "xla"     # 'cpu' | 'xla': see ``matmul``

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_f, out_f = tuple(self.in_features), tuple(self.out_features)
        assert len(self.kernel_axes) == len(in_f) + len(out_f), "one axis name per kernel dim"
        kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, tuple(self.kernel_axes)),
                            in_f + out_f, self.param_dtype)
        batch_shape = x.shape[:x.ndim - len(in_f)]
        k, n = int(np.prod(in_f)), int(np.prod(out_f))
        bias = None
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                   tuple(self.kernel_axes[len(in_f):])),
                              out_f, self.param_dtype).reshape(n)
        if self.kernels == "xla" and (len(in_f) > 1 or len(out_f) > 1):
            # The attention projections (heads axes): one dot over x's own axes, not a matmul of
            # reshaped 2-d views, so XLA:TPU picks the heads layouts itself (``_dense_nd``).
            y = _dense_nd(x, kernel, len(in_f), self.dtype)
            if bias is not None:
                y = y + bias.reshape(out_f).astype(jnp.float32)
            return y.astype(self.dtype)
        y = matmul(x.reshape(-1, k), kernel.reshape(k, n), self.dtype, bias, self.kernels)
        return y.astype(self.dtype).reshape(batch_shape + out_f)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis, statistics in f32, output in ``dtype``. Params: scale, bias."""

    epsilon: float = 1e-12
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                           (features,), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,)),
                          (features,), self.param_dtype)
        x = x.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, as BERT's ``hidden_act="gelu"`` and PyTorch: ``x/2 · (1 + erf(x/√2))``, in f32.

    Written with ``erf`` rather than ``jax.nn.gelu``'s ``erfc``: XLA evaluates f32 ``erf`` as a
    rational polynomial but ``erfc`` through ``exp``, a third of the step's element-wise time on a
    CPU. Same function (both are exact up to f32 rounding)."""
    xf = x.astype(jnp.float32)
    return (0.5 * xf * (1.0 + jax.lax.erf(xf * np.float32(np.sqrt(0.5))))).astype(x.dtype)
