"""COCO-LM: each loss against a naive numpy version, the sampling's distribution, gradient
isolation of the generator, sharded == unsharded, k micro-batches == one batch, and a tiny run
whose binary head beats the all-"original" baseline."""

import dataclasses
import functools
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tacl_jax import hf, parallel, tokens
from tacl_jax.config import load_config_file, override
from tacl_jax.data import synthetic
from tacl_jax.objectives import coco_lm as obj
from tacl_jax.train import coco_step
from tacl_jax.train import setup as setup_lib
from tacl_jax.train.optimizer import make_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def coco_config(**overrides):
    """``configs/coco_lm_tiny.py`` with a 1-layer main model (compile time dominates these tests)."""
    c = load_config_file(str(ROOT / "configs" / "coco_lm_tiny.py"))
    c.init.scratch.num_hidden_layers = 1
    return override(c, overrides)


def _no_dropout(c):
    c.model.hidden_dropout_prob = 0.0
    c.model.attention_probs_dropout_prob = 0.0
    return c


def _setup(config, mesh_sizes, devices):
    """Mesh, model, sharded state and step config; cached (tests share the initialisation)."""
    return dict(_setup_cached(config.to_json(), tuple(mesh_sizes.items()), tuple(devices)))


@functools.lru_cache(maxsize=None)
def _setup_cached(config_json, mesh_items, devices):
    config = ml_collections.ConfigDict(json.loads(config_json))
    mesh = parallel.make_mesh(dict(mesh_items), list(devices))
    rules = parallel.LOGICAL_AXIS_RULES
    tx, schedule = make_optimizer(config.optim, config.num_train_steps)
    model = setup_lib.model_from_config(config)
    state, state_sh = setup_lib.create_state(model, tx, mesh, rules, config.seed, config.max_len)
    special = tokens.default_special_ids(model.config.vocab_size)
    sc = coco_step.coco_step_config_from(config, special, mesh)
    return dict(mesh=mesh, rules=rules, model=model, tx=tx, schedule=schedule, state=state, state_sh=state_sh,
                sc=sc, special=special)


def _batch(config, step, special, short_seq_prob=0.3):
    return synthetic.global_batch(config.seed, step, config.global_batch_size, max_len=config.max_len,
                                  vocab_size=config.init.scratch.vocab_size, first_regular_id=5,
                                  cls_id=special["cls"], sep_id=special["sep"], pad_id=special["pad"],
                                  short_seq_prob=short_seq_prob)


def _grads(s, batch_np, rng_step=0):
    fn = coco_step.make_coco_loss_and_grads(s["model"], s["sc"])
    with jax.set_mesh(s["mesh"]), nn.logical_axis_rules(s["rules"]):
        batch = {k: jax.device_put(v, parallel.batch_sharding(s["mesh"], v.ndim)) for k, v in batch_np.items()}
        out = jax.jit(fn)(s["state"].params, None, batch, jax.random.fold_in(jax.random.key(0), rng_step))
    return jax.device_get(out)


def _assert_trees_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------- pure functions vs numpy

def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_binary_loss_matches_numpy():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 7)) * 3
    y = rng.integers(0, 2, (3, 7))
    mask = rng.integers(0, 2, (3, 7))
    want = -(y * np.log(_sigmoid(z)) + (1 - y) * np.log(1 - _sigmoid(z)))
    want_loss = (want * mask).sum() / mask.sum()
    want_acc = (((z > 0) == (y == 1)) * mask).sum() / mask.sum()
    loss, acc = obj.binary_loss(jnp.asarray(z, jnp.float32), jnp.asarray(y), jnp.asarray(mask))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(acc, want_acc, rtol=1e-6)


def test_clm_loss_matches_numpy_and_its_weight_is_detached():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 3, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 3))
    z = rng.normal(size=(2, 3)).astype(np.float32)
    w = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    ce = -np.take_along_axis(_log_softmax(logits.astype(np.float64)), targets[..., None], -1)[..., 0]
    want = ((1 - _sigmoid(z)) * ce * w).sum() / w.sum()
    loss, _ = obj.clm_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(z), jnp.asarray(w))
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    dz = jax.grad(lambda zz: obj.clm_loss(jnp.asarray(logits), jnp.asarray(targets), zz, jnp.asarray(w))[0])(
        jnp.asarray(z))
    assert np.all(np.asarray(dz) == 0), "sg(1 − σ(z)): no gradient into the binary head through the weight"


def _clm_mixture_numpy(logits, targets, z, copied):
    """−log(1[copied]·σ(z) + σ(−z)·softmax(logits)[target]), float64, straight from the formula."""
    s = np.exp(np.take_along_axis(_log_softmax(logits.astype(np.float64)), targets[..., None], -1)[..., 0])
    p = copied * _sigmoid(z) + _sigmoid(-z) * s
    return -np.log(p), s


@pytest.mark.parametrize("form", ["copy_mixture", "copy_mixture_sg"])
def test_clm_copy_mixture_matches_numpy_and_its_gradients(form):
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(2, 4, 9)) * 2).astype(np.float32)
    targets = rng.integers(0, 9, (2, 4))
    z = (rng.normal(size=(2, 4)) * 2).astype(np.float32)
    copied = np.array([[1, 0, 1, 0], [0, 1, 1, 0]], bool)
    w = np.array([[1, 1, 1, 0], [1, 1, 0, 1]], np.float32)
    want, s = _clm_mixture_numpy(logits, targets, z.astype(np.float64), copied)
    args = (jnp.asarray(logits), jnp.asarray(targets))
    nll, correct = obj.clm_per_position(*args, jnp.asarray(z), jnp.asarray(copied), form)
    np.testing.assert_allclose(nll, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(correct, (np.argmax(logits, -1) == targets).astype(np.float32))
    loss, _ = obj.clm_loss(*args, jnp.asarray(z), jnp.asarray(w), jnp.asarray(copied), form)
    np.testing.assert_allclose(loss, (want * w).sum() / w.sum(), rtol=1e-5)
    # Where not copied the mixture is −log σ(−z) − log s: CE plus softplus(z).
    ce = -np.log(s)
    np.testing.assert_allclose(np.asarray(nll)[~copied], (ce + np.logaddexp(0, z))[~copied], rtol=1e-5)

    dz = np.asarray(jax.grad(lambda zz: obj.clm_per_position(*args, zz, jnp.asarray(copied), form)[0].sum())(
        jnp.asarray(z)))
    if form == "copy_mixture_sg":
        assert np.all(dz == 0), "copy_mixture_sg: p_copy detached inside the mixture"
    else:
        # d(−log p)/dz: σ(z) where not copied; −σ(z)σ(−z)(1 − s)/p where copied.
        zz = z.astype(np.float64)
        p = np.exp(-want)
        want_dz = np.where(copied, -_sigmoid(zz) * _sigmoid(-zz) * (1 - s) / p, _sigmoid(zz))
        np.testing.assert_allclose(dz, want_dz, rtol=1e-4, atol=1e-6)
    # The LM logits: the CE's gradient times the mixture's share of the LM term.
    dl = np.asarray(jax.grad(lambda ll: obj.clm_per_position(ll, args[1], jnp.asarray(z), jnp.asarray(copied),
                                                             form)[0].sum())(args[0]))
    share = _sigmoid(-z.astype(np.float64)) * s / np.exp(-want)
    soft = np.exp(_log_softmax(logits.astype(np.float64)))
    want_dl = share[..., None] * (soft - np.eye(9)[targets])
    np.testing.assert_allclose(dl, want_dl, rtol=1e-4, atol=1e-6)


def test_clm_copy_mixture_is_finite_at_the_extremes():
    """Saturated copy logits and a target the LM gives ~0 probability: no log(0), no NaN."""
    logits = jnp.asarray([[[0.0, 200.0, -200.0]] * 4])            # target 2: log softmax ≈ −400
    targets = jnp.asarray([[2, 2, 1, 2]])
    z = jnp.asarray([[80.0, -80.0, 80.0, 80.0]])
    copied = jnp.asarray([[True, True, False, False]])
    for form in ("copy_mixture", "copy_mixture_sg"):
        f = lambda zz, ll: obj.clm_per_position(ll, targets, zz, copied, form)[0].sum()
        nll = obj.clm_per_position(logits, targets, z, copied, form)[0]
        grads = jax.grad(f, argnums=(0, 1))(z, logits)
        assert np.all(np.isfinite(nll)) and all(np.all(np.isfinite(g)) for g in grads), form
        # copied: −log(σ(z) + σ(−z)·e^−400) ≈ softplus(−z); not copied: softplus(z) + CE.
        np.testing.assert_allclose(nll, [[0.0, 80.0, 80.0, 480.0]], rtol=1e-3, atol=1e-3)


def _nt_xent_numpy(q, k, tau, group_size):
    """A naive loop over the groups of ``group_size`` rows (0 = all) and over each group's views."""
    b = q.shape[0]
    n = group_size or b
    out = np.zeros((2, b))
    correct = np.zeros((2, b))
    norm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    for g in range(b // n):
        rows = np.arange(g * n, (g + 1) * n)
        views = [(0, r) for r in rows] + [(1, r) for r in rows]
        vec = {(0, r): norm(q[r]) for r in rows} | {(1, r): norm(k[r]) for r in rows}
        for a in views:
            others = [v for v in views if v != a]
            sims = np.array([vec[a] @ vec[v] / tau for v in others])
            pos = others.index((1 - a[0], a[1]))
            out[a] = -(sims[pos] - np.log(np.exp(sims).sum()))
            correct[a] = float(np.argmax(sims) == pos)
    return out, correct


@pytest.mark.slow
@pytest.mark.parametrize("group_size,tau", [(0, 1.0), (2, 1.0), (3, 1.0), (2, 0.1), (1, 1.0)])
def test_nt_xent_matches_numpy(group_size, tau):
    rng = np.random.default_rng(2)
    q = rng.normal(size=(6, 5))
    k = q + 0.8 * rng.normal(size=(6, 5))
    nll, correct = obj.nt_xent_per_view(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), tau, group_size)
    want_nll, want_correct = _nt_xent_numpy(q, k, tau, group_size)
    np.testing.assert_allclose(nll, want_nll, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(correct, want_correct)
    loss, _ = obj.nt_xent_loss(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), tau, group_size)
    np.testing.assert_allclose(loss, want_nll.mean(), rtol=1e-5, atol=1e-7)
    if group_size == 1:                     # one sequence per group: its other view is the only candidate
        np.testing.assert_allclose(nll, 0.0, atol=1e-6)


@pytest.mark.slow
def test_nt_xent_one_group_of_the_whole_batch_is_the_ungrouped_loss():
    rng = np.random.default_rng(5)
    q, k = (jnp.asarray(rng.normal(size=(8, 4)), jnp.float32) for _ in range(2))
    whole = obj.nt_xent_per_view(q, k, 0.5, 8)
    ungrouped = obj.nt_xent_per_view(q, k, 0.5, 0)
    for a, b in zip(whole, ungrouped):
        np.testing.assert_array_equal(a, b)
    # ... and groups of 4 differ from it (fewer negatives: a lower loss).
    assert float(obj.nt_xent_per_view(q, k, 0.5, 4)[0].sum()) < float(ungrouped[0].sum())
    with pytest.raises(ValueError, match="groups of 3"):
        obj.nt_xent_per_view(q, k, 0.5, 3)


def test_corrupt_and_crop_match_numpy():
    ids = np.array([[2, 10, 11, 12, 13, 14, 3, 0, 0, 0], [2, 20, 21, 22, 23, 24, 25, 26, 27, 3]], np.int32)
    att = (ids != 0).astype(np.int32)
    types = np.array([[0, 0, 0, 0, 1, 1, 1, 0, 0, 0], [0] * 10], np.int32)
    masked = ids.copy()
    masked[0, 2] = masked[1, 4] = masked[1, 5] = 4
    positions = np.array([[2, 0], [4, 5]], np.int32)
    weights = np.array([[1, 0], [1, 1]], np.float32)
    samples = np.array([[11, 99], [77, 24]], np.int32)      # row 0 resamples the original; 99 is a pad slot
    x_corr, replaced = obj.corrupt(jnp.asarray(masked), jnp.asarray(positions), jnp.asarray(weights),
                                   jnp.asarray(samples), jnp.asarray(ids), jnp.asarray(att))
    want = ids.copy()
    want[1, 4] = 77
    np.testing.assert_array_equal(x_corr, want)
    np.testing.assert_array_equal(replaced, want != ids)
    assert int(np.asarray(replaced).sum()) == 1

    u = np.array([0.999, 0.0], np.float32)
    view = obj.crop_views(jnp.asarray(ids), jnp.asarray(att), jnp.asarray(types), jnp.asarray(u), fraction=0.9,
                          cls_id=2, pad_id=0)
    for b in range(2):
        n = int(att[b].sum())
        c = max(1, int(np.floor(0.9 * (n - 1))))
        start = 1 + min(int(np.floor(u[b] * (n - 1 - c + 1))), n - 1 - c)
        want_ids = np.zeros(10, np.int32)
        want_ids[0] = 2
        want_ids[1:c + 1] = ids[b, start:start + c]
        want_types = np.zeros(10, np.int32)
        want_types[1:c + 1] = types[b, start:start + c]
        np.testing.assert_array_equal(view["input_ids"][b], want_ids)
        np.testing.assert_array_equal(view["token_type_ids"][b], want_types)
        np.testing.assert_array_equal(view["attention_mask"][b], (np.arange(10) <= c).astype(np.int32))
    # Row 0 (u≈1) ends at the last real token; row 1 (u=0) starts right after [CLS].
    assert view["input_ids"][0, 5] == 3 and view["input_ids"][1, 1] == 20


def test_sampling_matches_the_softmax_chi_square():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0, -jnp.inf], [0.0, 0.0, 0.0, 0.0, 0.0], [-3.0, 3.0, 1.0, 0.5, 0.0]])
    n = 20_000
    u = jax.random.uniform(jax.random.key(3), (n, 3))
    draws = np.asarray(obj.sample_tokens(jnp.broadcast_to(logits, (n, 3, 5)), u))
    probs = np.asarray(jax.nn.softmax(logits, -1))
    for row in range(3):
        counts = np.bincount(draws[:, row], minlength=5)
        support = probs[row] > 0
        assert counts[~support].sum() == 0, "a zero-probability token was drawn"
        expected = n * probs[row][support]
        chi2 = ((counts[support] - expected) ** 2 / expected).sum()
        # 99.9% quantiles of χ² with 3 and 4 degrees of freedom.
        assert chi2 < {3: 16.27, 4: 18.47}[int(support.sum()) - 1], (row, counts, expected)


# ----------------------------------------------------------------------------- the step

@pytest.mark.slow
def test_no_gradient_reaches_the_generator_from_the_main_losses():
    config = coco_config()
    s = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    model = s["model"]
    batch = {k: jnp.asarray(v) for k, v in _batch(config, 0, s["special"]).items()}

    def main_losses(params):
        # The binary, CLM and SCL terms only: the generator's MLM left out.
        mb = coco_step.prepare_batch(model, s["sc"], batch, jax.random.key(1))
        counts = coco_step._counts(mb)
        _, sums = coco_step.make_coco_loss_fn(model, s["sc"])(params, mb, counts, jax.random.key(2))
        return obj.coco_total(sums, counts, dict(binary=50.0, clm=1.0, scl=1.0))

    with jax.set_mesh(s["mesh"]), nn.logical_axis_rules(s["rules"]):
        g_main = jax.device_get(jax.jit(jax.grad(main_losses))(s["state"].params))
    norm = lambda t: float(sum(np.abs(x).sum() for x in jax.tree.leaves(t)))
    assert norm(g_main["generator"]) == 0.0, "a main-model loss reached the generator's own parameters"
    assert norm(g_main["main"]["encoder"]) > 0 and norm(g_main["heads"]) > 0
    # The networks meet only in the shared embeddings, which exist once (under main/).
    assert norm(g_main["main"]["embeddings"]) > 0 and "embeddings" not in g_main["generator"]


@pytest.mark.slow
def test_sharded_loss_and_grads_equal_single_device():
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    config = coco_config()
    one = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    many = _setup(config, dict(data=2, fsdp=2, tensor=2), jax.devices())
    _assert_trees_close(jax.device_get(one["state"].params), jax.device_get(many["state"].params), 0, 0)
    batch = _batch(config, 0, one["special"])
    l1, s1, g1 = _grads(one, batch)
    l8, s8, g8 = _grads(many, batch)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    assert set(s1) == set(s8) and "scl_nll" in s1
    for k in s1:
        np.testing.assert_allclose(s8[k], s1[k], rtol=1e-5, atol=1e-5, err_msg=k)
    _assert_trees_close(g8, g1, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_k_micro_batches_equal_one_batch():
    # SCL's negatives are the micro-batch's by construction, so its weight is 0 here; every other
    # term (and the sampling, the mask and the crops) must not depend on the split.
    config = _no_dropout(coco_config(global_batch_size=8))
    config.coco_lm.loss_weights.scl = 0.0
    one = _setup(config, dict(data=2, fsdp=1, tensor=1), jax.devices()[:2])
    acc = dict(one, sc=dataclasses.replace(one["sc"], grad_accum_steps=4))
    batch = _batch(config, 3, one["special"])
    l1, s1, g1 = _grads(one, batch)
    l4, s4, g4 = _grads(acc, batch)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    for k in s1:
        np.testing.assert_allclose(s4[k], s1[k], rtol=1e-5, atol=1e-5, err_msg=k)
    _assert_trees_close(g4, g1, rtol=1e-3, atol=1e-5)
    lengths = (batch["input_ids"] != 0).sum(1)
    assert len(set(lengths[i::4].sum() for i in range(4))) > 1, "micro-batches of equal size test no weighting"


@pytest.mark.slow
def test_accumulation_on_a_data_mesh_keeps_the_micro_batch_scl_negatives():
    """k = 4 on a 2-device data mesh (``step.accumulate``'s ``shard_map``: each device's loss on
    its rows, one ``psum`` per step) equals k = 4 on one device (the plain scan), SCL included:
    with ``scl_group_size`` = 0 each micro-batch's whole set of views is gathered across the
    shards (the group-size paths: ``test_scl_groups_do_not_depend_on_the_mesh_or_accumulation``).
    Dropout off: the shards draw their own masks."""
    from tacl_jax.train.update import shard_map_applies

    config = _no_dropout(coco_config(global_batch_size=16, grad_accum_steps=4))
    config.coco_lm.scl_group_size = 0
    many = _setup(config, dict(data=2, fsdp=1, tensor=1), jax.devices()[:2])
    one = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    assert shard_map_applies(many["mesh"]) and not shard_map_applies(one["mesh"])
    assert many["sc"].grad_accum_steps == 4 and many["sc"].scl_group_size == 0
    batch = _batch(config, 5, one["special"])
    l1, s1, g1 = _grads(one, batch)
    l2, s2, g2 = _grads(many, batch)
    assert s1["scl_nll"] > 0 and s1["n_view"] == 32
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for k in s1:
        np.testing.assert_allclose(s2[k], s1[k], rtol=1e-5, atol=1e-5, err_msg=k)
    _assert_trees_close(g2, g1, rtol=1e-3, atol=1e-5)


# (mesh sizes, devices, grad_accum_steps), each against one device with one batch: the plain scan
# of 2 micro-batches on one device; accumulate's shard_map with the groups inside each device's
# rows (data=2) and across devices (data=8: one row per device per micro-batch, gathered); a
# 2×2×2 mesh (the plain scan, fsdp). 8 devices without accumulation (2×2×2):
# test_sharded_loss_and_grads_equal_single_device, whose tiny config has groups of 4 too.
SCL_INVARIANCE_CASES = {
    "1dev_k2": (dict(data=1, fsdp=1, tensor=1), 1, 2),
    "data2_k2": (dict(data=2, fsdp=1, tensor=1), 2, 2),
    "data8_k2": (dict(data=8, fsdp=1, tensor=1), 8, 2),
    "2x2x2_k2": (dict(data=2, fsdp=2, tensor=2), 8, 2),
}


def _scl_group_config():
    config = _no_dropout(coco_config(global_batch_size=16))
    config.coco_lm.scl_group_size = 4
    return config


def _distinct_sequences(s):
    """The setup with the main encoder's kernels ×10. At the initialisation every [CLS] embedding
    is nearly the same vector (cosines ≈ 1, NT-Xent ≈ ln(2G − 1) whatever the groups): the
    SCL loss could not tell the right negatives from wrong ones (it does here: 0.5% apart)."""
    def scale(path, x):
        keys = jax.tree_util.keystr(path)
        return x * 10.0 if "['main']['encoder']" in keys and "kernel" in keys else x
    params = jax.tree_util.tree_map_with_path(scale, s["state"].params)
    return dict(s, state=dataclasses.replace(s["state"], params=params))


@functools.lru_cache(maxsize=None)
def _scl_group_reference():
    config = _scl_group_config()
    ref = _distinct_sequences(_setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1]))
    batch = _batch(config, 7, ref["special"])
    return batch, _grads(ref, batch)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SCL_INVARIANCE_CASES))
def test_scl_groups_do_not_depend_on_the_mesh_or_accumulation(case):
    """``coco_lm.scl_group_size`` = 4 on a batch of 16: the step's SCL loss (and every other
    sum, the loss and the gradients) on one device with one batch equals the same step on other
    meshes and with 2 micro-batches of 8, i.e. the negatives are the rows [4g, 4g+4) of the
    global batch wherever they are computed. Dropout off."""
    mesh_sizes, n_dev, k = SCL_INVARIANCE_CASES[case]
    batch, (l1, s1, g1) = _scl_group_reference()
    other = _distinct_sequences(_setup(_scl_group_config(), mesh_sizes, jax.devices()[:n_dev]))
    other["sc"] = dataclasses.replace(other["sc"], grad_accum_steps=k)
    l2, s2, g2 = _grads(other, batch)
    assert s1["n_view"] == 32 and s2["n_view"] == 32
    # Groups of 4: each view has 7 candidates, so the loss is near ln 7 (ln 31 for all 16).
    assert 1.5 < s1["scl_nll"] / 32 < 0.5 * (np.log(7) + np.log(31)), s1["scl_nll"] / 32
    np.testing.assert_allclose(s2["scl_nll"], s1["scl_nll"], rtol=1e-5, err_msg="SCL loss")
    np.testing.assert_array_equal(s2["scl_correct"], s1["scl_correct"], err_msg="SCL accuracy")
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for key in s1:
        np.testing.assert_allclose(s2[key], s1[key], rtol=1e-5, atol=1e-5, err_msg=key)
    _assert_trees_close(g2, g1, rtol=1e-3, atol=1e-5)


def test_scl_group_size_config_errors():
    from tacl_jax.errors import ConfigError

    special = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    config = coco_config(global_batch_size=16, grad_accum_steps=4)
    config.coco_lm.scl_group_size = 8                      # micro-batches of 4
    with pytest.raises(ConfigError, match=r"scl_group_size=8: a micro-batch of 4 sequences .*grad_accum_steps in "
                                          r"\[1, 2\]"):
        coco_step.coco_step_config_from(config, special)
    config.coco_lm.loss_weights.scl = 0.0                  # no SCL: no groups to fit
    assert coco_step.coco_step_config_from(config, special).scl_group_size == 8
    config.coco_lm.loss_weights.scl = 1.0
    config.coco_lm.scl_group_size = 0                      # the whole micro-batch
    assert coco_step.coco_step_config_from(config, special).scl_group_size == 0
    old = coco_config()
    with old.unlocked():                                   # a config file of the old key
        old.coco_lm.scl_negatives = "local"
    with pytest.raises(ConfigError, match="scl_negatives='local' was replaced by coco_lm.scl_group_size"):
        coco_step.coco_step_config_from(old, special)
    # The range table: negative; larger than the micro-batch: the step's check.
    from tacl_jax.config import validate
    c = coco_config(global_batch_size=16)
    c.coco_lm.scl_group_size = -1
    with pytest.raises(ConfigError, match="coco_lm.scl_group_size=-1 is out of range"):
        validate(c)
    c.coco_lm.scl_group_size = 32
    validate(c)
    with pytest.raises(ConfigError, match="a micro-batch of 16 sequences"):
        coco_step.coco_step_config_from(c, special)
    c = coco_config()
    c.coco_lm.clm_form = "mixture"
    with pytest.raises(ConfigError, match="coco_lm.clm_form='mixture'"):
        validate(c)


@pytest.mark.slow
def test_copy_mixture_step_trains_the_copy_head_through_the_clm():
    """clm_form='copy_mixture' in the step: the CLM term alone reaches the binary head (the
    posted form's detached weight does not); the CLM sums differ between the forms while the
    other terms do not."""
    config = _no_dropout(coco_config())
    s = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    batch = {k: jnp.asarray(v) for k, v in _batch(config, 0, s["special"]).items()}
    out = {}
    for form in ("weighted_ce", "copy_mixture"):
        sc = dataclasses.replace(s["sc"], clm_form=form)

        def clm_only(params, sc=sc):
            mb = coco_step.prepare_batch(s["model"], sc, batch, jax.random.key(1))
            counts = coco_step._counts(mb)
            _, sums = coco_step.make_coco_loss_fn(s["model"], sc)(params, mb, counts, jax.random.key(2))
            return obj.coco_total(sums, counts, dict(clm=1.0)), sums

        with jax.set_mesh(s["mesh"]), nn.logical_axis_rules(s["rules"]):
            grads, sums = jax.device_get(jax.jit(jax.grad(clm_only, has_aux=True))(s["state"].params))
        out[form] = (float(np.abs(grads["heads"]["binary"]["kernel"]).sum()), sums)
    assert out["weighted_ce"][0] == 0.0 and out["copy_mixture"][0] > 0
    a, b = out["weighted_ce"][1], out["copy_mixture"][1]
    assert not np.isclose(a["clm_nll"], b["clm_nll"])
    for key in ("gen_nll", "bin_nll", "scl_nll", "clm_correct", "n_pred"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-6, err_msg=key)


def _progressions(batch_size, max_len, first, span, seed=0):
    """[CLS] a a+1 a+2 ... [SEP] over ``span`` ids from ``first`` (mod span): a replaced token is
    detectable from its identity while the generator still samples outside those ids, and from
    its neighbours after."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, span, batch_size)
    body = first + (starts[:, None] + np.arange(max_len - 2)[None]) % span
    ids = np.concatenate([np.full((batch_size, 1), 2), body, np.full((batch_size, 1), 3)], 1).astype(np.int32)
    return dict(input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.zeros_like(ids))


@pytest.mark.slow
def test_tiny_run_binary_accuracy_beats_the_all_original_baseline(tmp_path):
    config = _no_dropout(coco_config(global_batch_size=16, num_train_steps=40))
    config.optim.learning_rate = 3e-3
    config.optim.warmup_steps = 5
    s = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    step = coco_step.make_coco_train_step(s["model"], s["sc"], s["tx"], s["schedule"])
    batches = [_progressions(16, config.max_len, 5, 16, seed=i) for i in range(4)]
    n_tok = float(batches[0]["attention_mask"].sum())
    state, hist = s["state"], []
    with jax.set_mesh(s["mesh"]), nn.logical_axis_rules(s["rules"]):
        fn = jax.jit(step)
        for i in range(config.num_train_steps):
            state, m = fn(state, None, batches[i % 4], jax.random.key(0))
            hist.append({k: float(v) for k, v in jax.device_get(m).items()})
    last = hist[-5:]
    acc = np.mean([h["binary_acc"] for h in last])
    baseline = np.mean([1 - h["replaced_frac"] * h["masked_tokens"] / n_tok for h in last])
    assert all(np.isfinite(h["loss"]) for h in hist)
    assert hist[-1]["loss"] < hist[0]["loss"], (hist[0]["loss"], hist[-1]["loss"])
    assert acc > baseline + 0.02, (acc, baseline, hist[-1])
    # The main model exports as a plain BertForMaskedLM; the generator and heads are not in it.
    out = hf.save(s["model"].main, state.params["main"], str(tmp_path / "export"))
    assert (pathlib.Path(out) / "model.safetensors").is_file()
