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
from tacl_jax.config import load_config_file
from tacl_jax.data import synthetic
from tacl_jax.objectives import coco_lm as obj
from tacl_jax.train import coco_step
from tacl_jax.train.optimizer import make_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def coco_config(**overrides):
    """``configs/coco_lm_tiny.py`` with a 1-layer main model (compile time dominates these tests)."""
    c = load_config_file(str(ROOT / "configs" / "coco_lm_tiny.py"))
    c.init.scratch.num_hidden_layers = 1
    for k, v in overrides.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return c


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
    state, state_sh, model = coco_step.init_coco_state(config, mesh, rules, tx=tx)
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
        out = jax.jit(fn)(s["state"].params, batch, jax.random.fold_in(jax.random.key(0), rng_step))
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


def _nt_xent_numpy(q, k, tau, groups):
    b = q.shape[0]
    n = b // groups
    out = np.zeros((2, b))
    correct = np.zeros((2, b))
    norm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    for g in range(groups):
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


@pytest.mark.parametrize("groups,tau", [(1, 1.0), (3, 1.0), (2, 0.1)])
def test_nt_xent_matches_numpy(groups, tau):
    rng = np.random.default_rng(2)
    q = rng.normal(size=(6, 5))
    k = q + 0.8 * rng.normal(size=(6, 5))
    nll, correct = obj.nt_xent_per_view(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), tau, groups)
    want_nll, want_correct = _nt_xent_numpy(q, k, tau, groups)
    np.testing.assert_allclose(nll, want_nll, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(correct, want_correct)
    loss, _ = obj.nt_xent_loss(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), tau, groups)
    np.testing.assert_allclose(loss, want_nll.mean(), rtol=1e-5)


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


@pytest.mark.parametrize("negatives", ["global", "local"])
def test_accumulation_on_a_data_mesh_keeps_the_micro_batch_scl_negatives(negatives):
    """k = 4 on a 2-device data mesh (``step.accumulate``'s ``shard_map``: each device's loss on
    its rows, one ``psum`` per step) equals k = 4 on one device (the plain scan), SCL included:
    'global' negatives are gathered across the shards, 'local' ones are each shard's rows (one
    group per shard on the single device too). Dropout off: the shards draw their own masks."""
    from tacl_jax.train.step import shard_map_applies

    config = _no_dropout(coco_config(global_batch_size=16))
    config.coco_lm.scl_negatives = negatives
    many = _setup(config, dict(data=2, fsdp=1, tensor=1), jax.devices()[:2])
    one = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    assert shard_map_applies(many["mesh"]) and not shard_map_applies(one["mesh"])
    many["sc"] = dataclasses.replace(many["sc"], grad_accum_steps=4)
    one["sc"] = dataclasses.replace(many["sc"], scl_groups=many["sc"].scl_groups)   # local: 2 groups
    batch = _batch(config, 5, one["special"])
    l1, s1, g1 = _grads(one, batch)
    l2, s2, g2 = _grads(many, batch)
    assert s1["scl_nll"] > 0 and s1["n_view"] == 32
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for k in s1:
        np.testing.assert_allclose(s2[k], s1[k], rtol=1e-5, atol=1e-5, err_msg=k)
    _assert_trees_close(g2, g1, rtol=1e-3, atol=1e-5)


def _progressions(batch_size, max_len, first, span, seed=0):
    """[CLS] a a+1 a+2 ... [SEP] over ``span`` ids from ``first`` (mod span): a replaced token is
    detectable from its identity while the generator still samples outside those ids, and from
    its neighbours after."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, span, batch_size)
    body = first + (starts[:, None] + np.arange(max_len - 2)[None]) % span
    ids = np.concatenate([np.full((batch_size, 1), 2), body, np.full((batch_size, 1), 3)], 1).astype(np.int32)
    return dict(input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.zeros_like(ids))


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
