"""Dropout from 16-bit uniforms (tacl_jax.models.dropout): the distribution, the scaling, the
sharding invariance, and the switch back to flax's nn.Dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tacl_jax import config as config_lib
from tacl_jax.models import BertConfig, BertModel
from tacl_jax.models.dropout import dropout, drop_threshold, uniform16


def test_uniform16_is_uniform_and_halves_are_independent():
    u = np.asarray(uniform16(jax.random.key(0), (64, 1024))).astype(np.int64)
    assert u.min() >= 0 and u.max() < 65536
    # 64 buckets of the top 6 bits: chi-square with 63 dof has mean 63, sd ~11; 130 is > 6 sd.
    counts = np.bincount(u.ravel() >> 10, minlength=64)
    expected = u.size / 64
    assert ((counts - expected) ** 2 / expected).sum() < 130
    # The quarters of one block (elements 4j..4j+3) and neighbours across blocks: no correlation.
    x = u.astype(np.float64) / 65536 - 0.5
    for a, b in ((x[:, 0::4], x[:, 1::4]), (x[:, 1::4], x[:, 2::4]), (x[:, 0::4], x[:, 3::4]),
                 (x[:, 3:-1:4], x[:, 4::4])):
        r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(r) < 5 / np.sqrt(a.size), r
    # Rows and keys differ; one key is reproducible.
    assert not np.array_equal(u[0], u[1])
    assert np.array_equal(u, np.asarray(uniform16(jax.random.key(0), (64, 1024))))
    assert not np.array_equal(u, np.asarray(uniform16(jax.random.key(1), (64, 1024))))


def test_uniform16_odd_last_axis_is_a_prefix_of_the_even_draw():
    """A last axis that is not a multiple of 4 draws ceil(n/4) blocks per row and drops the rest."""
    key = jax.random.key(3)
    odd = np.asarray(uniform16(key, (5, 7)))
    even = np.asarray(uniform16(key, (5, 8)))
    np.testing.assert_array_equal(odd, even[:, :7])



def test_uniform16_are_the_quarters_of_threefry_blocks_at_row_column_counters():
    """Reference: JAX's public ``threefry_2x32`` on the counters (row, j) of every block j of every
    row, split into 16-bit quarters with numpy; block j of a row holds elements 4j..4j+3."""
    from jax.extend.random import threefry_2x32

    key = jax.random.key(7)
    shape = (3, 5, 10)                                    # 3 blocks per row, the last one half used
    rows, cols = np.meshgrid(np.arange(15, dtype=np.uint32), np.arange(3, dtype=np.uint32), indexing="ij")
    out = np.asarray(threefry_2x32(jax.random.key_data(key), jnp.concatenate([rows.ravel(), cols.ravel()])))
    w1, w2 = out[:45].reshape(3, 5, 3), out[45:].reshape(3, 5, 3)
    quarters = np.stack([w1 & 0xFFFF, w1 >> 16, w2 & 0xFFFF, w2 >> 16], -1).reshape(3, 5, 12)[..., :10]
    np.testing.assert_array_equal(np.asarray(uniform16(key, shape)), quarters)

@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_keep_fraction_scale_and_mean(rate):
    x = jax.random.normal(jax.random.key(1), (32, 64, 128), jnp.float32)
    y = np.asarray(dropout(x, rate, jax.random.key(2)))
    x = np.asarray(x)
    t = drop_threshold(rate)
    keep = y != 0
    p_keep = 1 - t / 65536
    n = x.size
    assert abs(keep.mean() - p_keep) < 5 * np.sqrt(p_keep * (1 - p_keep) / n)
    # Kept elements are scaled by exactly 65536 / (65536 - t) (f32), dropped ones are 0.
    np.testing.assert_allclose(y[keep], x[keep] * np.float32(65536 / (65536 - t)), rtol=1e-6)
    # Unbiased: E[y] = x. On a constant input the mean of y is 1 within sampling error.
    ones = np.asarray(dropout(jnp.ones((256, 1024)), rate, jax.random.key(4)))
    sd = np.sqrt((1 - p_keep) / p_keep / ones.size)
    assert abs(ones.mean() - 1) < 5 * sd


def test_dropout_edge_rates_and_dtype():
    x = jax.random.normal(jax.random.key(1), (4, 6), jnp.bfloat16)
    assert dropout(x, 0.0, jax.random.key(0)) is x
    np.testing.assert_array_equal(np.asarray(dropout(x, 1.0, jax.random.key(0)), np.float32), 0)
    y = dropout(x, 0.1, jax.random.key(0))
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    with pytest.raises(ValueError, match="not in \\[0, 1\\]"):
        dropout(x, 1.5, jax.random.key(0))


def test_dropout_sharded_equals_unsharded():
    """The mask depends only on the key and the shape, not on how the array is laid out."""
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
    x = jax.random.normal(jax.random.key(5), (8, 16, 64), jnp.float32)
    f = jax.jit(lambda a, k: dropout(a, 0.1, k))
    ref = np.asarray(f(x, jax.random.key(6)))
    for spec in (P("data", None, "tensor"), P(None, "tensor", None), P("data", "tensor", None)):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        out = jax.jit(lambda a, k: dropout(a, 0.1, k), out_shardings=NamedSharding(mesh, spec))(
            xs, jax.random.key(6))
        np.testing.assert_array_equal(np.asarray(out), ref)


def test_xla_uniform16_are_the_quarters_of_threefry_blocks_in_slabs_along_axis_minus_2():
    """``kernels='xla'``: block ``(r, n)`` of the ``[..., M/4, N]`` counters (same threefry, same
    row-major row rule) holds rows ``r + a·M/4`` (a = 0..3) of column n; shapes it cannot split so
    (1-d, ``M % 4 != 0``) draw as 'cpu'."""
    from jax.extend.random import threefry_2x32

    key = jax.random.key(7)
    shape = (3, 8, 5)                                     # counters [3, 2, 5]
    rows, cols = np.meshgrid(np.arange(6, dtype=np.uint32), np.arange(5, dtype=np.uint32), indexing="ij")
    out = np.asarray(threefry_2x32(jax.random.key_data(key), jnp.concatenate([rows.ravel(), cols.ravel()])))
    w1, w2 = out[:30].reshape(3, 2, 5), out[30:].reshape(3, 2, 5)
    slabs = np.concatenate([w1 & 0xFFFF, w1 >> 16, w2 & 0xFFFF, w2 >> 16], axis=1)
    np.testing.assert_array_equal(np.asarray(uniform16(key, shape, "xla")), slabs)
    for odd in ((10,), (3, 6, 5)):
        np.testing.assert_array_equal(np.asarray(uniform16(key, odd, "xla")), np.asarray(uniform16(key, odd)))


def test_xla_uniform16_is_uniform_and_slabs_are_independent():
    u = np.asarray(uniform16(jax.random.key(0), (16, 256, 256), "xla")).astype(np.int64)
    assert u.min() >= 0 and u.max() < 65536
    counts = np.bincount(u.ravel() >> 10, minlength=64)
    expected = u.size / 64
    assert ((counts - expected) ** 2 / expected).sum() < 130
    # The four quarters of one block (rows r, r + 64, r + 128, r + 192) and neighbouring blocks.
    x = u.astype(np.float64) / 65536 - 0.5
    for a, b in ((x[:, :64], x[:, 64:128]), (x[:, 64:128], x[:, 128:192]), (x[:, :64], x[:, 192:]),
                 (x[:, :63], x[:, 1:64]), (x[:, :, :-1], x[:, :, 1:])):
        r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(r) < 5 / np.sqrt(a.size), r
    assert not np.array_equal(u, np.asarray(uniform16(jax.random.key(1), (16, 256, 256), "xla")))


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_xla_dropout_keep_fraction_scale_and_mean(rate):
    x = jax.random.normal(jax.random.key(1), (32, 64, 128), jnp.float32)
    y = np.asarray(dropout(x, rate, jax.random.key(2), "xla"))
    x = np.asarray(x)
    t = drop_threshold(rate)
    keep = y != 0
    p_keep = 1 - t / 65536
    assert abs(keep.mean() - p_keep) < 5 * np.sqrt(p_keep * (1 - p_keep) / x.size)
    np.testing.assert_allclose(y[keep], x[keep] * np.float32(65536 / (65536 - t)), rtol=1e-6)
    ones = np.asarray(dropout(jnp.ones((256, 1024)), rate, jax.random.key(4), "xla"))
    assert abs(ones.mean() - 1) < 5 * np.sqrt((1 - p_keep) / p_keep / ones.size)
    # A different arrangement than 'cpu' (same key): not the same mask.
    assert not np.array_equal(ones != 0, np.asarray(dropout(jnp.ones((256, 1024)), rate, jax.random.key(4))) != 0)


def test_xla_dropout_sharded_equals_unsharded():
    """'xla' arrangement: the mask depends only on the key and the shape, whichever axes are
    sharded (axis -2 included, where blocks cross shards)."""
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
    x = jax.random.normal(jax.random.key(5), (8, 4, 16, 64), jnp.float32)
    f = lambda a, k: dropout(a, 0.1, k, "xla")   # noqa: E731
    ref = np.asarray(jax.jit(f)(x, jax.random.key(6)))
    for spec in (P("data", "tensor", None, None), P(None, None, None, "tensor"), P("data", None, "tensor", None)):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        out = jax.jit(f, out_shardings=NamedSharding(mesh, spec))(xs, jax.random.key(6))
        np.testing.assert_array_equal(np.asarray(out), ref)


def _tiny(bits, rate=0.3):
    return BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=16, dtype="float32",
                      hidden_dropout_prob=rate, attention_probs_dropout_prob=rate, dropout_bits=bits)


@pytest.mark.slow
def test_bert_dropout_bits_switch():
    """Both draws are real dropout (outputs differ from the deterministic pass and between keys);
    16 and 32 bits draw different masks; deterministic passes agree."""
    ids = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % 60 + 3
    types = jnp.zeros_like(ids)
    outs = {}
    for bits in (16, 32):
        model = BertModel(_tiny(bits))
        params = model.init(jax.random.key(0), ids)["params"]

        def run(det, key, model=model, params=params):
            return model.apply({"params": params}, ids, jnp.ones_like(ids), types, deterministic=det,
                               rngs={"dropout": key}).last_hidden_state
        outs[bits] = (run(True, jax.random.key(1)), run(False, jax.random.key(1)), run(False, jax.random.key(2)))
    np.testing.assert_array_equal(outs[16][0], outs[32][0])
    for bits in (16, 32):
        det, a, b = outs[bits]
        assert not np.allclose(det, a) and not np.allclose(a, b)
    assert not np.allclose(outs[16][1], outs[32][1])


def test_bad_dropout_settings_are_refused():
    with pytest.raises(ValueError, match="dropout_bits"):
        _tiny(8)
    c = config_lib.default_config()
    c.model.dropout_bits = 8
    with pytest.raises(ValueError, match="config.model.dropout_bits=8"):
        config_lib.validate(c)
    c = config_lib.default_config()
    c.model.hidden_dropout_prob = 1.0
    with pytest.raises(ValueError, match="hidden_dropout_prob"):
        config_lib.validate(c)


def test_other_prng_implementations_draw_through_jax_random_bits():
    """An ``rbg`` key (``jax_default_prng_impl``) takes the ``jax.random.bits`` path: same rate."""
    y = np.asarray(dropout(jnp.ones((64, 1024)), 0.1, jax.random.key(0, impl="rbg")))
    p_keep = 1 - drop_threshold(0.1) / 65536
    assert abs((y != 0).mean() - p_keep) < 5 * np.sqrt(p_keep * (1 - p_keep) / y.size)
    np.testing.assert_allclose(np.unique(y), [0.0, 65536 / (65536 - drop_threshold(0.1))], rtol=1e-6)
