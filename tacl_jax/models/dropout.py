"""Dropout drawn from 16-bit random numbers, four per threefry block: a quarter of the PRNG work
of ``flax.linen.Dropout``.

Why: ``nn.Dropout`` draws each element's bit with ``jax.random.bernoulli``, which (in JAX's
partitionable threefry mode) runs one ``threefry2x32`` block per element and keeps 32 of its 64
output bits; here one block gives four 16-bit uniforms. On a CPU the saving is mostly memory
(XLA's temporary buffer), since XLA:CPU overlaps the hashing with the matmuls. Measurements:
docs/performance.md#dropout.

The rate is quantised to ``t / 65536`` (``t = round(rate · 65536)``): 0.1 becomes 0.099998, and
kept elements are scaled by the exact ``65536 / (65536 - t)``, so the expectation is unchanged.
Block ``j`` of row ``r`` (the row-major index over all but the last axis) has the counter
``(r, j)`` and drops elements ``4j .. 4j + 3`` of that row, so an element's block lies in the same
shard as the element whenever the last axis is split in multiples of 4, and the counters do not
depend on the sharding: a sharded run draws the same mask as one device. (Two 32-bit counter
words: up to 2**32 rows of 2**34 elements, however large the global batch.) Keys of other PRNG
implementations (``rbg``) draw the two words of each block with ``jax.random.bits`` instead.

That arrangement (``kernels='cpu'``) interleaves the quarters along the last axis: on a TPU, the
lane axis, so XLA:TPU would copy every mask through a shuffle. With ``kernels='xla'`` (and
``shape[-2] % 4 == 0``, else as above) the quarters lie along axis -2 in four contiguous slabs:
block ``(r, n)`` of the ``[..., M/4, N]`` counters (same row-major rule) drops rows ``r``,
``r + M/4``, ``r + M/2``, ``r + 3M/4`` of column n. The counters still depend only on global
indices, and every element's block lies in its own shard unless axis -2 is sharded (it is the
sequence axis here, which is not).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

DROPOUT_BITS = (16, 32)   # 16: this module; 32: flax's nn.Dropout


def drop_threshold(rate: float) -> int:
    """The 16-bit threshold ``t``: an element is dropped when its uniform in [0, 65536) is < t."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"dropout rate {rate} is not in [0, 1]")
    return int(round(rate * 65536))


def _row_iota(shape: tuple[int, ...]) -> jax.Array:
    """``uint32[shape]``: each element's row index, row-major over all axes but the last (built
    per axis, so it shards)."""
    out, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape) - 1)):
        out = out + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    return out


def _blocks(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Two ``uint32[shape]`` words per element of ``shape`` (at least 1-d): one threefry2x32
    block each, counter = (row, position in the row)."""
    if int(np.prod(shape[:-1])) >= 2 ** 32 or shape[-1] >= 2 ** 32:
        raise ValueError(f"dropout of {shape}: 2**32 rows or more, or a row of 2**34 elements or "
                         "more; reshape the array")
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if typed and str(jax.random.key_impl(key)) != "threefry2x32":
        words = jax.random.bits(key, shape + (2,), jnp.uint32)
        return words[..., 0], words[..., 1]
    k1, k2 = jax.random.key_data(key) if typed else key
    return threefry2x32_p.bind(k1, k2, _row_iota(shape),
                               jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1))


def _quarters(key: jax.Array, shape: tuple[int, ...], fn) -> jax.Array:
    """``fn`` applied to 16-bit uniforms (uint32 in [0, 65536)) of ``shape``: four per block,
    interleaved along the last axis after ``fn`` (so a boolean ``fn`` moves 1 byte per element)."""
    if not shape:
        return _quarters(key, (1,), fn)[0]
    last = shape[-1]
    w1, w2 = _blocks(key, shape[:-1] + ((last + 3) // 4,))
    parts = [fn(w1 & 0xFFFF), fn(w1 >> 16), fn(w2 & 0xFFFF), fn(w2 >> 16)]
    return jnp.stack(parts, axis=-1).reshape(shape[:-1] + (4 * w1.shape[-1],))[..., :last]


def _slabs(key: jax.Array, shape: tuple[int, ...], fn) -> jax.Array:
    """``kernels='xla'``: ``fn`` of 16-bit uniforms of ``shape`` (at least 2-d, ``shape[-2] % 4 ==
    0``), the four quarters of block ``(r, n)`` of ``shape[:-2] + (M/4, N)`` at rows ``r + a·M/4``
    (a = 0..3) of axis -2: four contiguous slabs, concatenated without moving an element."""
    m = shape[-2] // 4
    w1, w2 = _blocks(key, shape[:-2] + (m, shape[-1]))
    return jnp.concatenate([fn(w1 & 0xFFFF), fn(w1 >> 16), fn(w2 & 0xFFFF), fn(w2 >> 16)], axis=-2)


def _draw(key: jax.Array, shape: tuple[int, ...], fn, kernels: str) -> jax.Array:
    if kernels == "xla" and len(shape) >= 2 and shape[-2] % 4 == 0:
        return _slabs(key, shape, fn)
    return _quarters(key, shape, fn)


def uniform16(key: jax.Array, shape: tuple[int, ...], kernels: str = "cpu") -> jax.Array:
    """Independent uniform integers in [0, 65536) of ``shape`` (uint32), as dropout draws them
    with ``kernels`` (module doc)."""
    return _draw(key, tuple(shape), lambda u: u, kernels)


def dropout(x: jax.Array, rate: float, key: jax.Array, kernels: str = "cpu") -> jax.Array:
    """``x [...]`` with each element zeroed with probability ``t / 65536`` (see the module doc)
    and the rest scaled by ``65536 / (65536 - t)``; same shape and dtype (scaled in f32, one
    rounding). ``kernels``: which arrangement of the draw ('cpu' or 'xla', module doc)."""
    t = drop_threshold(rate)
    if t == 0:
        return x
    if t >= 65536:
        return jnp.zeros_like(x)
    keep = _draw(key, x.shape, lambda u: u >= np.uint32(t), kernels)
    scale = np.float32(65536.0 / (65536 - t))
    return jnp.where(keep, (x.astype(jnp.float32) * scale).astype(x.dtype), jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """``nn.Dropout``'s interface (``Dropout(rate)(x, deterministic=...)``, keys from the
    ``'dropout'`` rng collection) with ``bits`` = 16 (this module's draw) or 32 (flax's);
    ``kernels`` ('cpu' | 'xla', ``BertConfig.kernels``) picks the arrangement of the 16-bit draw."""

    rate: float
    bits: int = 16
    kernels: str = "cpu"

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if self.bits == 32:
            return nn.Dropout(self.rate)(x, deterministic=deterministic)
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"), self.kernels)
