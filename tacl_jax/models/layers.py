"""Building blocks for the BERT model: a dense layer with logical axis names and a matmul whose
backward pass stays in the compute dtype.

Why a custom matmul: with bf16 inputs and an f32 result (``preferred_element_type``), plain
autodiff produces f32 cotangents, so XLA upcasts and runs the two backward matmuls (2/3 of the
FLOPs) in f32. ``matmul`` casts the incoming cotangent to the compute dtype first, keeping f32
accumulation: on CPUs with AVX-512 bf16 and on TPUs/GPUs that is the fast path. In fp32 mode it is
an ordinary matmul.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Initializer = nn.initializers.Initializer


def matmul(x: jax.Array, w: jax.Array, compute_dtype) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in ``compute_dtype`` with f32 accumulation.

    Returns f32 (the accumulator); the caller casts. Both operands are cast to ``compute_dtype``.
    """
    return _matmul_for(jnp.dtype(compute_dtype).name)(x, w)


@functools.lru_cache(maxsize=None)
def _matmul_for(dtype_name: str):
    dt = jnp.dtype(dtype_name)

    @jax.custom_vjp
    def mm(x, w):
        return jnp.dot(x.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)

    def fwd(x, w):
        xc, wc = x.astype(dt), w.astype(dt)
        # Residuals are kept in the compute dtype: half the memory of f32 in bf16 mode.
        return jnp.dot(xc, wc, preferred_element_type=jnp.float32), (xc, wc, jnp.zeros((), x.dtype),
                                                                      jnp.zeros((), w.dtype))

    def bwd(res, g):
        xc, wc, x_like, w_like = res
        g = g.astype(dt)
        dx = jnp.dot(g, wc.T, preferred_element_type=jnp.float32).astype(x_like.dtype)
        dw = jnp.dot(xc.T, g, preferred_element_type=jnp.float32).astype(w_like.dtype)
        return dx, dw

    mm.defvjp(fwd, bwd)
    return mm


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

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_f, out_f = tuple(self.in_features), tuple(self.out_features)
        assert len(self.kernel_axes) == len(in_f) + len(out_f), "one axis name per kernel dim"
        kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, tuple(self.kernel_axes)),
                            in_f + out_f, self.param_dtype)
        batch_shape = x.shape[:x.ndim - len(in_f)]
        k, n = int(np.prod(in_f)), int(np.prod(out_f))
        y = matmul(x.reshape(-1, k), kernel.reshape(k, n), self.dtype)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                   tuple(self.kernel_axes[len(in_f):])),
                              out_f, self.param_dtype)
            y = y + bias.reshape(n).astype(jnp.float32)
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
    """Exact (erf) GELU, as BERT's ``hidden_act="gelu"``; computed in f32."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)
