"""The hand-written backward passes of the model's building blocks against plain autodiff.

``tacl_jax.models.layers`` and ``tacl_jax.objectives.mlm`` replace autodiff for speed (bias
gradients as matmuls, no transposed copies, one-pass softmax cross-entropy); these tests pin that
the values and every gradient are those of the textbook formulas.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tacl_jax.models import BertConfig, BertModel
from tacl_jax.models.attention import dot_product_attention
from tacl_jax.models import layers
from tacl_jax.models.layers import gelu, matmul, tied_decoder
from tacl_jax.objectives import mlm_per_position

import hlo_text


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _grads(f, *args):
    """Value and gradients w.r.t. all args of ``sum(f(*args) * cotangent)`` (a fixed random cotangent)."""
    out = f(*args)
    ct = _rand(99, out.shape)
    return jax.value_and_grad(lambda *a: jnp.sum(f(*a) * ct), argnums=tuple(range(len(args))))(*args)


@pytest.mark.parametrize("kernels", ["cpu", "xla"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_value_and_grads_equal_autodiff(with_bias, kernels):
    """Both kernel families (XLA:CPU's bias gradient as a matmul, plain XLA's reduction) are the
    matmul's gradients."""
    x, w, b = _rand(0, (12, 7)), _rand(1, (7, 5)), _rand(2, (5,))
    ours = ((lambda x, w, b: matmul(x, w, jnp.float32, b, kernels)) if with_bias
            else (lambda x, w, b: matmul(x, w, jnp.float32, kernels=kernels)))
    ref = (lambda x, w, b: x @ w + b) if with_bias else (lambda x, w, b: x @ w + 0 * b)
    (v1, g1), (v2, g2) = _grads(ours, x, w, b), _grads(ref, x, w, b)
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    for a, r in zip(g1, g2):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["cpu", "xla"])
@pytest.mark.parametrize("in_f,out_f", [((6,), (3, 4)), ((3, 4), (6,)), ((6,), (5,))])
def test_dense_with_heads_axes_value_and_grads_equal_a_plain_tensordot(kernels, in_f, out_f):
    """``Dense`` with several feature axes (the attention projections: with ``kernels='xla'`` one
    ``dot_general`` on the unreshaped arrays, else the 2-d ``matmul``): value and the gradients
    w.r.t. input, kernel and bias are those of ``tensordot(x, W) + b``."""
    dense = layers.Dense(in_f, out_f, ("a",) * (len(in_f) + len(out_f)), kernels=kernels)
    x = _rand(0, (2, 5) + in_f)
    params = {"kernel": _rand(2, in_f + out_f), "bias": _rand(3, out_f)}

    def ours(x, w, b):
        return dense.apply({"params": {"kernel": w, "bias": b}}, x)

    def ref(x, w, b):
        return jnp.tensordot(x, w, axes=len(in_f), precision="highest") + b

    (v1, g1), (v2, g2) = (_grads(f, x, params["kernel"], params["bias"]) for f in (ours, ref))
    np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-5)
    for a, r in zip(g1, g2):
        assert a.shape == r.shape and a.dtype == r.dtype
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["cpu", "xla"])
def test_bf16_dense_with_heads_axes_rounds_like_the_2d_matmul(kernels):
    """bf16 compute: the heads-axes ``Dense`` gives the 2-d ``matmul``'s value (bf16 operands, f32
    accumulation, one rounding) and its gradients to bf16 accuracy."""
    x, w, b = _rand(0, (2, 8, 32)), _rand(1, (32, 4, 8)), _rand(2, (4, 8))
    dense = layers.Dense((32,), (4, 8), ("a", "b", "c"), dtype=jnp.bfloat16, kernels=kernels)

    def ours(x, w, b):
        return dense.apply({"params": {"kernel": w, "bias": b}}, x).astype(jnp.float32)

    def ref(x, w, b):
        y = matmul(x.reshape(-1, 32), w.reshape(32, 32), jnp.bfloat16, b.reshape(32), "cpu")
        return y.astype(jnp.bfloat16).astype(jnp.float32).reshape(2, 8, 4, 8)

    (v1, g1), (v2, g2) = _grads(ours, x, w, b), _grads(ref, x, w, b)
    np.testing.assert_array_equal(v1, v2)
    for a, r in zip(g1, g2):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, r, rtol=2e-2, atol=2e-2)


def test_bf16_matmul_keeps_f32_accumulation_and_bf16_backward():
    """bf16 operands: the result equals the f32 matmul of the bf16-rounded operands (f32
    accumulation), and the gradients those of the bf16-rounded cotangent."""
    x, w, b = _rand(0, (16, 64)), _rand(1, (64, 8)), _rand(2, (8,))
    rx, rw = x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
    y = matmul(x, w, jnp.bfloat16, b)
    np.testing.assert_allclose(y, rx @ rw + b, rtol=1e-5, atol=1e-5)
    ct = _rand(3, y.shape)
    dx, dw, db = jax.grad(lambda x, w, b: jnp.sum(matmul(x, w, jnp.bfloat16, b) * ct), (0, 1, 2))(x, w, b)
    rct = ct.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(dx, rct @ rw.T, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dw, rx.T @ rct, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(db, ct.sum(0), rtol=1e-5, atol=1e-5)   # the bias gradient stays f32
    assert dx.dtype == dw.dtype == db.dtype == jnp.float32


@pytest.mark.slow
@pytest.mark.parametrize("copy", [True, False])
def test_bf16_weight_gradients_through_the_transposed_copy(monkeypatch, copy):
    """bf16 ``dW = xᵀ·g`` and the tied decoder's ``d table = gᵀ·h`` equal numpy's product of the
    bf16-rounded operands (f32 accumulation), with the transposed copy and without; and on the CPU
    the copy turns XLA's row contraction (``lhs_contracting_dims={0}``, upcast to f32 by XLA:CPU)
    into a canonical dot."""
    monkeypatch.setattr(layers, "CPU_BF16_TRANSPOSED_COPY", copy)
    x, w, ct = _rand(0, (48, 24)), _rand(1, (24, 40)), _rand(2, (48, 40))
    h, table, ctd = _rand(3, (20, 24)), _rand(4, (56, 24)), _rand(5, (20, 56))

    def loss(x, w, h, table):
        return (jnp.sum(matmul(x, w, jnp.bfloat16, kernels="cpu") * ct)
                + jnp.sum(tied_decoder(h, table, jnp.zeros((56,)), jnp.bfloat16, kernels="cpu") * ctd))

    grad = jax.jit(jax.grad(loss, argnums=(1, 3)))
    dw, dtable = grad(x, w, h, table)
    r = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    np.testing.assert_allclose(dw, r(x).T @ r(ct), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dtable, r(ctd).T @ r(h), rtol=1e-4, atol=1e-4)
    if jax.default_backend() == "cpu":
        hlo = grad.lower(x, w, h, table).compile().as_text()
        assert ("lhs_contracting_dims={0}" in hlo) == (not copy), "the row contraction is (not) folded away"
        # The two weight-gradient dots run on bf16 operands with the copy; XLA:CPU upcasts the row
        # contraction to f32 without it (a transpose XLA folds back would show f32 here too).
        operands = {t for _, a, b in _dots(hlo) for t in (a, b)}
        assert operands == ({"bf16"} if copy else {"f32"}), (_dots(hlo), hlo)


@pytest.mark.parametrize("shape", [(6, 4), (5, 7), (38, 30), (2, 2)])
def test_transposed_copy_is_the_transpose(shape):
    """Both constructions (3-d transpose for even K, concatenated halves for odd K) are ``aᵀ``."""
    a = (np.arange(math.prod(shape)) % 251).astype(np.float32).reshape(shape)   # exact in bf16
    np.testing.assert_array_equal(np.asarray(jax.jit(layers._transposed_copy)(jnp.asarray(a, jnp.bfloat16))
                                             .astype(jnp.float32)), a.T)


def _dots(hlo: str) -> list[tuple[str, str, str]]:
    """``(result dtype, lhs dtype, rhs dtype)`` of every dot in compiled HLO text."""
    return [(d.out_dtype, d.lhs_dtype, d.rhs_dtype) for d in hlo_text.dots(hlo)]


def test_transposed_copy_by_default_only_on_cpus_with_bf16_units(monkeypatch):
    from tacl_jax import precision

    monkeypatch.setattr(layers, "CPU_BF16_TRANSPOSED_COPY", None)
    for flags, expected in ((frozenset({"avx2", "avx512f"}), False), (frozenset({"avx512_bf16"}), True),
                            (frozenset({"amx_bf16"}), True)):
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: flags)
        assert layers._use_transposed_copy() is expected
    monkeypatch.setattr(layers, "CPU_BF16_TRANSPOSED_COPY", False)
    assert layers._use_transposed_copy() is False


def test_tied_decoder_value_and_grads_equal_autodiff():
    h, table, bias = _rand(0, (9, 6)), _rand(1, (11, 6)), _rand(2, (11,))
    (v1, g1) = _grads(lambda h, t, b: tied_decoder(h, t, b, jnp.float32), h, table, bias)
    (v2, g2) = _grads(lambda h, t, b: h @ t.T + b, h, table, bias)
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    for a, r in zip(g1, g2):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)


def test_fused_cross_entropy_matches_log_softmax_and_argmax():
    logits, targets = _rand(0, (3, 5, 37), 3.0), jax.random.randint(jax.random.key(1), (3, 5), 0, 37)
    nll, correct = mlm_per_position(logits, targets)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    t = np.asarray(targets)
    ref_nll = -np.take_along_axis(logp, t[..., None], -1)[..., 0]
    np.testing.assert_allclose(nll, ref_nll, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(correct, (np.argmax(np.asarray(logits), -1) == t).astype(np.float32))
    # The gradient of a weighted sum of nll: w · (softmax − onehot), checked against autodiff.
    w = _rand(2, (3, 5))
    g_ours = jax.grad(lambda x: jnp.sum(mlm_per_position(x, targets)[0] * w))(logits)
    g_ref = jax.grad(lambda x: -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(x, -1), targets[..., None], -1)[..., 0]
                                        * w))(logits)
    np.testing.assert_allclose(g_ours, g_ref, rtol=1e-5, atol=1e-6)


def test_gelu_is_the_exact_erf_gelu():
    x = np.linspace(-8, 8, 401).astype(np.float32)
    ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    np.testing.assert_allclose(gelu(jnp.asarray(x)), ref, rtol=1e-5, atol=1e-6)
    # and its derivative: Φ(x) + x·φ(x)
    d = jax.vmap(jax.grad(lambda v: gelu(v)))(jnp.asarray(x))
    dref = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi)
                     for v in x.astype(np.float64)])
    np.testing.assert_allclose(d, dref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernels", ["xla", "cpu"])
def test_attention_matches_a_naive_loop(kernels):
    b, length, nh, hd = 2, 5, 3, 4
    q, k, v = _rand(0, (b, length, nh, hd)), _rand(1, (b, length, nh, hd)), _rand(2, (b, length, nh, hd))
    mask = np.ones((b, length), np.float32)
    mask[1, 3:] = 0
    bias = jnp.where(jnp.asarray(mask)[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    ours = np.asarray(dot_product_attention(q, k, v, bias, kernels=kernels))
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    ref = np.zeros_like(qn)
    for bi in range(b):
        for h in range(nh):
            for i in range(length):
                s = np.array([qn[bi, i, h] @ kn[bi, j, h] / math.sqrt(hd) if mask[bi, j] else -np.inf
                              for j in range(length)])
                p = np.exp(s - s.max())
                p /= p.sum()
                ref[bi, i, h] = p @ vn[bi, :, h]
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 8, 2, 4), (2, 20, 2, 4), (1, 9, 2, 8)])
def test_bf16_attention_through_canonical_copies_equals_the_einsum_path(monkeypatch, shape):
    """The XLA:CPU bf16 attention (materialised heads transposes, hand-written backward of
    canonical dots) gives the einsum path's context and q/k/v gradients, with dropout and a masked
    key; and on the CPU all its dots run on bf16 operands, where the einsum path's are upcast to
    f32. The shapes take both branches of the cheaper-copy choice (L <= 2d and L > 2d) and an odd
    L (the concatenated copy); each has a dimension of at least 8, below which YNNPACK leaves a dot
    to XLA's f32 fallback."""
    b, length, nh, hd = shape
    q, k, v, ct = (_rand(i, shape).astype(jnp.bfloat16) for i in range(4))
    bias = jnp.zeros((b, 1, 1, length)).at[0, ..., -1].set(-1e9)
    mult = jnp.where(_rand(5, (b, nh, length, length)) > 1.2, 0.0, 1.0 / 0.9)   # a dropout mask

    def run(copy):
        monkeypatch.setattr(layers, "CPU_BF16_TRANSPOSED_COPY", copy)

        def loss(q, k, v):
            out = dot_product_attention(q, k, v, bias, dropout=lambda p: p * mult, kernels="cpu")
            assert out.dtype == jnp.bfloat16 and out.shape == shape
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = fn(q, k, v)
        return out, grads, fn.lower(q, k, v).compile().as_text()

    (out1, g1, hlo1), (out0, g0, hlo0) = run(True), run(False)
    f = lambda a: np.asarray(a, np.float32)   # noqa: E731
    np.testing.assert_allclose(f(out1), f(out0), rtol=2e-2, atol=2e-2)
    for a, r in zip(g1, g0):   # bf16 cotangents on the copy path: relative error ~1e-2 of the norm
        assert a.dtype == jnp.bfloat16
        assert np.linalg.norm(f(a) - f(r)) <= 2e-2 * np.linalg.norm(f(r)), (a, r)
    np.testing.assert_array_equal(f(g1[1])[0, -1], 0.0)   # the masked key gets no gradient
    if jax.default_backend() == "cpu":
        assert {t for _, x, y in _dots(hlo1) for t in (x, y)} == {"bf16"}, _dots(hlo1)
        assert len(_dots(hlo1)) == 6   # two forward, four backward: none folded away
        assert {t for _, x, y in _dots(hlo0) for t in (x, y)} == {"f32"}   # what the copies avoid


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_attention_value_and_grads_equal_the_f32_autodiff_path(dtype):
    """``kernels='xla'`` (softmax out in the compute dtype, its own backward from that output,
    dropout on it) against plain autodiff of the f32 'cpu' path, with dropout and a masked key:
    equal in f32, within bf16 rounding in bf16."""
    shape = b, length, nh, hd = 2, 16, 2, 8
    q, k, v, ct = (_rand(i, shape) for i in range(4))
    bias = jnp.zeros((b, 1, 1, length)).at[0, ..., -1].set(jnp.finfo(jnp.float32).min)
    mult = jnp.where(_rand(5, (b, nh, length, length)) > 1.2, 0.0, 1.0 / 0.9)   # a dropout mask

    def loss(q, k, v, kernels, dt):
        out = dot_product_attention(q.astype(dt), k.astype(dt), v.astype(dt), bias,
                                    dropout=lambda p: (p * mult).astype(p.dtype), kernels=kernels)
        assert out.dtype == dt and out.shape == shape
        return jnp.sum(out.astype(jnp.float32) * ct)

    ref_val, ref = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, "cpu", jnp.float32)
    val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=(3, 4))(q, k, v, "xla", dtype)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(val, ref_val, rtol=tol, atol=tol * 10)
    for a, r in zip(grads, ref):
        assert np.linalg.norm(np.float32(a) - np.float32(r)) <= tol * np.linalg.norm(np.float32(r))
    np.testing.assert_array_equal(np.float32(grads[1])[0, -1], 0.0)   # the masked key: no gradient


@pytest.mark.parametrize("m,k,n", [(6, 4, 6), (20, 20, 4), (5, 7, 3)])
def test_attention_batched_products_take_either_copy(m, k, n):
    """``a·bᵀ`` and ``aᵀ·b`` of ``tacl_jax.models.attention`` equal numpy's products, with f32
    accumulation of bf16 operands, in the requested output dtype; ``aᵀ·b`` copying ``a`` (first and
    last shapes) or ``b`` and the result (the middle one)."""
    from tacl_jax.models import attention

    ints = lambda i, s: jnp.asarray((np.arange(math.prod(s)) * (7 + i) % 13 - 6).reshape(s), jnp.bfloat16)  # noqa: E731
    a, b = ints(0, (2, 3, m, k)), ints(1, (2, 3, n, k))
    nt = jax.jit(attention._bmm_nt, static_argnums=2)(a, b, jnp.float32)
    np.testing.assert_array_equal(nt, np.einsum("bhmk,bhnk->bhmn", np.float32(a), np.float32(b)))
    a, b = ints(2, (2, 3, k, m)), ints(3, (2, 3, k, n))
    tn = jax.jit(attention._bmm_tn, static_argnums=2)(a, b, jnp.bfloat16)
    assert tn.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.float32(tn), np.einsum("bhkm,bhkn->bhmn", np.float32(a), np.float32(b)))


@pytest.mark.slow
def test_padded_vocab_logits_give_the_same_loss_and_grads():
    """The training path (``padded_vocab=True``: padding columns at -1e9, no slice) and the public
    path (logits sliced to the real vocabulary) agree on the MLM loss and every gradient."""
    cfg = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, dtype="float32")
    assert cfg.padded_vocab_size == 128
    model = BertModel(cfg)
    ids = jax.random.randint(jax.random.key(0), (2, 8), 5, 100)
    positions = jnp.asarray([[1, 3, 5], [0, 2, 7]])
    targets = jax.random.randint(jax.random.key(1), (2, 3), 0, 100)
    params = nn.meta.unbox(model.init(jax.random.key(2), ids)["params"])

    def loss(p, padded):
        out = model.apply({"params": p}, ids, mlm_positions=positions, padded_vocab=padded)
        assert out.mlm_logits.shape[-1] == (128 if padded else 100)
        return jnp.sum(mlm_per_position(out.mlm_logits, targets)[0])

    (l1, g1), (l2, g2) = (jax.value_and_grad(loss)(params, True), jax.value_and_grad(loss)(params, False))
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    jax.tree.map(lambda a, r: np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7), g1, g2)
    np.testing.assert_array_equal(np.asarray(g1["mlm_bias"])[100:], 0.0)   # padding never learns
