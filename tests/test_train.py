"""The fused train step: sharded == unsharded, accumulation == one big batch, it learns, and the
loop's start-up checks."""

import json
import pathlib

import flax.linen as nn
import jax
import numpy as np
import pytest

from tacl_jax import parallel, tokens
from tacl_jax.config import load_config_file, override
from tacl_jax.data import synthetic
from tacl_jax.train import loop
from tacl_jax.train import setup as setup_lib
from tacl_jax.train import step as step_lib
from tacl_jax.train.optimizer import make_optimizer
from tacl_jax.train.step import make_loss_and_grads, make_train_step, step_config_from
from tacl_jax.train.update import accumulate, shard_map_applies

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_config(**overrides):
    c = load_config_file(str(ROOT / "configs" / "tiny.py"))
    return override(c, overrides)


def _setup(config, mesh_sizes, devices):
    mesh = parallel.make_mesh(mesh_sizes, devices)
    rules = parallel.LOGICAL_AXIS_RULES
    model, _ = setup_lib.build_model(config)
    tx, schedule = make_optimizer(config.optim, config.num_train_steps)
    state, state_sh = setup_lib.create_state(model, tx, mesh, rules, config.seed, config.max_len)
    special = tokens.default_special_ids(model.config.vocab_size)
    step_cfg = step_config_from(config, special)
    teacher, teacher_sh = setup_lib.create_teacher(state.params, state_sh.params, "float32")
    return dict(mesh=mesh, rules=rules, model=model, tx=tx, schedule=schedule, state=state, state_sh=state_sh,
                step_cfg=step_cfg, teacher=teacher, teacher_sh=teacher_sh, special=special)


def _batch(config, step, model, special):
    return synthetic.global_batch(config.seed, step, config.global_batch_size, max_len=config.max_len,
                                  vocab_size=model.config.vocab_size, first_regular_id=5, cls_id=special["cls"],
                                  sep_id=special["sep"], pad_id=special["pad"], short_seq_prob=0.3,
                                  with_nsp=config.nsp)


def _grads(s, batch_np, rng_step=0):
    fn = make_loss_and_grads(s["model"], s["step_cfg"], step_lib.teacher_of(s["model"]))
    with jax.set_mesh(s["mesh"]), nn.logical_axis_rules(s["rules"]):
        batch = {k: jax.device_put(v, parallel.batch_sharding(s["mesh"], v.ndim)) for k, v in batch_np.items()}
        loss, sums, grads = jax.jit(fn)(s["state"].params, s["teacher"], batch,
                                        jax.random.fold_in(jax.random.key(0), rng_step))
    return jax.device_get((loss, sums, grads))


def _assert_trees_close(a, b, rtol, atol, leaf_atol=0.0):
    """Leaf by leaf; ``leaf_atol`` adds ``leaf_atol · max|b's leaf|`` to ``atol`` (sums that cancel
    to a small value carry the rounding of their large terms: compare them at the leaf's scale)."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        y = np.asarray(y)
        tol = atol + leaf_atol * float(np.max(np.abs(y), initial=0.0))
        np.testing.assert_allclose(np.asarray(x), y, rtol=rtol, atol=tol, err_msg=jax.tree_util.keystr(path))


# The 2×2×2 mesh (data, fsdp and tensor at once) stays in the fast tier; data-only 8 is slow.
@pytest.mark.parametrize("mesh_sizes", [dict(data=2, fsdp=2, tensor=2),
                                        pytest.param(dict(data=8, fsdp=1, tensor=1), marks=pytest.mark.slow)])
def test_sharded_loss_and_grads_equal_single_device(mesh_sizes):
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    config = tiny_config(nsp=True)
    one = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    many = _setup(config, mesh_sizes, jax.devices())
    # Same init on both meshes (params are initialised from the same key).
    _assert_trees_close(jax.device_get(one["state"].params), jax.device_get(many["state"].params), 0, 0)
    batch = _batch(config, 0, one["model"], one["special"])
    l1, s1, g1 = _grads(one, batch)
    l8, s8, g8 = _grads(many, batch)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    for k in s1:
        np.testing.assert_allclose(s8[k], s1[k], rtol=1e-5, atol=1e-5, err_msg=k)
    # f32 sums in another order (the word-embedding gradient's scatter-add over the batch, split
    # over devices): 1 of 16,384 entries once differed by 1.2e-5 (1.5e-4 relative, where its terms
    # cancel); a sharding error moves entries by their own size.
    _assert_trees_close(g8, g1, rtol=1e-4, atol=1e-6, leaf_atol=1e-4)
    assert "nsp_nll" in s1 and "tacl_nll" in s1


@pytest.mark.slow
def test_bf16_teacher_kernels_in_compute_dtype_change_nothing():
    """``tacl.teacher_param_dtype='compute'`` (the default) stores the teacher's kernels in bf16 once
    instead of casting them every step: loss and gradients are bit-identical to an f32 teacher."""
    config = tiny_config()
    config.model.dtype = "bfloat16"
    s = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    batch = _batch(config, 0, s["model"], s["special"])
    l32, s32, g32 = _grads(s, batch)
    s["teacher"], _ = setup_lib.create_teacher(s["state"].params, s["state_sh"].params, "compute", s["model"].config.dtype)
    kinds = {jax.tree_util.keystr(p).endswith("['kernel']"): x.dtype for p, x in
             jax.tree_util.tree_leaves_with_path(s["teacher"])}
    assert kinds == {True: jax.numpy.bfloat16, False: jax.numpy.float32}
    lc, sc, gc = _grads(s, batch)
    np.testing.assert_array_equal(lc, l32)
    _assert_trees_close(gc, g32, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("copy", [True, False])
def test_bf16_sharded_loss_and_grads_equal_single_device(monkeypatch, copy):
    """The bf16 step (with and without the CPU's transposed copy for weight gradients,
    ``layers.CPU_BF16_TRANSPOSED_COPY``) on a 2×2×2 mesh equals the single-device step; the two
    variants agree with each other (f32 accumulation either way)."""
    from tacl_jax.models import layers

    monkeypatch.setattr(layers, "CPU_BF16_TRANSPOSED_COPY", copy)
    config = tiny_config()
    config.model.dtype = "bfloat16"
    one = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    many = _setup(config, dict(data=2, fsdp=2, tensor=2), jax.devices())
    batch = _batch(config, 0, one["model"], one["special"])
    l1, _, g1 = _grads(one, batch)
    l8, _, g8 = _grads(many, batch)
    np.testing.assert_allclose(l8, l1, rtol=1e-3)
    _assert_trees_rel_close(g8, g1, 2e-2)
    monkeypatch.setattr(layers, "CPU_BF16_TRANSPOSED_COPY", not copy)
    l_other, _, g_other = _grads(one, batch)
    np.testing.assert_allclose(l_other, l1, rtol=1e-6)
    _assert_trees_rel_close(g_other, g1, 2e-2)


def _assert_trees_rel_close(a, b, tol):
    """Per leaf ``|a - b| <= tol · |b| + 1e-5`` (L2 norms): bf16 roundings differ with the reduction
    order, so element-wise tolerances would flag near-zero entries, while a wrong gradient is off by
    ~100%. (The absolute floor is for leaves whose exact gradient is 0, e.g. the key bias.)"""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        err, ref = np.linalg.norm(x - y), np.linalg.norm(y)
        assert err <= tol * ref + 1e-5, f"{jax.tree_util.keystr(path)}: |diff| {err:.3g} vs |ref| {ref:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("mesh_sizes", [dict(data=2, fsdp=1, tensor=1), dict(data=2, fsdp=2, tensor=2)])
def test_k_micro_batches_equal_one_batch(mesh_sizes):
    """Dropout off, k = 4 equals k = 1 on the same mesh: on a pure data mesh through
    ``step.accumulate``'s ``shard_map`` (partial gradients, one ``psum`` per step), on 2×2×2
    through the plain scan it falls back to."""
    n = mesh_sizes["data"] * mesh_sizes["fsdp"] * mesh_sizes["tensor"]
    config = tiny_config(global_batch_size=8)
    config.model.hidden_dropout_prob = 0.0      # dropout masks differ per micro-batch by design
    config.model.attention_probs_dropout_prob = 0.0
    one = _setup(config, mesh_sizes, jax.devices()[:n])
    config4 = tiny_config(global_batch_size=8, grad_accum_steps=4)
    config4.model.hidden_dropout_prob = 0.0
    config4.model.attention_probs_dropout_prob = 0.0
    acc = _setup(config4, mesh_sizes, jax.devices()[:n])
    assert shard_map_applies(acc["mesh"]) == (n == 2)
    batch = _batch(config, 3, one["model"], one["special"])
    l1, s1, g1 = _grads(one, batch)
    l4, s4, g4 = _grads(acc, batch)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    _assert_trees_close(g4, g1, rtol=1e-3, atol=1e-5)  # float summation order only
    for k in ("n_pred", "mlm_nll", "tacl_nll"):
        np.testing.assert_allclose(s4[k], s1[k], rtol=1e-5, err_msg=k)
    # Sanity: the micro-batches really had different masked-token counts (else weighting is untested).
    ids = batch["input_ids"]
    lengths = (ids != 0).sum(1)
    assert len(set(lengths[i::4].sum() for i in range(4))) > 1


def _called(ins) -> list[str]:
    """The computations an HLO instruction calls (loop bodies, fusions, reducers, branches)."""
    import re

    names = re.findall(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)", ins.rest)
    m = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
    return names + ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m else [])


def _gradient_reductions(text: str) -> tuple[int, int]:
    """``(inside, outside)``: all-reduce / reduce-scatter instructions (or fusions around one) of
    compiled HLO text inside some ``while`` loop's body or condition, and the others reachable
    from the entry."""
    from tacl_jax import hlo

    comps, entry = hlo.parse(text)
    counts = [0, 0]

    def walk(name, in_loop, seen):
        if (name, in_loop) in seen:
            return
        seen.add((name, in_loop))
        for ins in comps.get(name, []):
            if hlo._collective_kind(comps, ins) in ("all-reduce", "reduce-scatter"):
                counts[in_loop] += 1
            for callee in _called(ins):
                walk(callee, in_loop or ins.opcode == "while", seen)

    walk(entry, False, set())
    return counts[1], counts[0]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_sizes", [dict(data=2, fsdp=1, tensor=1), dict(data=1, fsdp=2, tensor=1)])
def test_accumulation_reduces_gradients_once_outside_the_loop(mesh_sizes):
    """The compiled k = 4 step on a 2-device data mesh reduces its gradients after the
    micro-batch loop, not inside it (XLA would otherwise all-reduce every micro-batch's
    gradient). The fsdp mesh is the control: there ``accumulate`` keeps the plain scan and
    the per-micro-batch reductions sit in the loop body, so the check does see them."""
    config = tiny_config(global_batch_size=8, grad_accum_steps=4)
    s = _setup(config, mesh_sizes, jax.devices()[:2])
    fn = make_loss_and_grads(s["model"], s["step_cfg"], step_lib.teacher_of(s["model"]))
    batch_np = _batch(config, 0, s["model"], s["special"])
    with jax.set_mesh(s["mesh"]), nn.logical_axis_rules(s["rules"]):
        batch = {k: jax.device_put(v, parallel.batch_sharding(s["mesh"], v.ndim)) for k, v in batch_np.items()}
        text = jax.jit(fn).lower(s["state"].params, s["teacher"], batch, jax.random.key(0)).compile().as_text()
    inside, outside = _gradient_reductions(text)
    if mesh_sizes["data"] == 2:
        assert inside == 0 and outside >= 1, (inside, outside)
    else:
        assert inside >= 1, (inside, outside)


def test_accumulate_folds_the_shard_index_into_the_dropout_keys():
    """``accumulate``'s keys, checked with a loss whose gradient is the uniform draw of its key:
    micro-batch i on data shard j draws from ``fold_in(split(rng, k)[i], j)``, so shards do
    not repeat one dropout mask; the rows' loss terms add up as without the mesh."""
    import jax.numpy as jnp

    k, n = 4, 2
    mesh = parallel.make_mesh(dict(data=n, fsdp=1, tensor=1), jax.devices()[:n])

    def loss_fn(p, extra, mb, counts, rng):
        loss = jnp.sum(p * jax.random.uniform(rng, p.shape)) + jnp.sum(mb["x"]) * p[0] / counts["n"]
        return loss, dict(rows=jnp.asarray(mb["x"].shape[0], jnp.float32))

    x = jnp.arange(16.0)
    counts = dict(n=x.sum())
    rng = jax.random.key(7)
    p = jnp.zeros((3,))
    with jax.set_mesh(mesh):
        loss, sums, grads = jax.jit(lambda p, b: accumulate(loss_fn, p, None, b, counts, rng, k))(
            p, dict(x=jax.device_put(x, parallel.batch_sharding(mesh, 1))))
    keys = jax.random.split(rng, k)
    expected = sum(jax.random.uniform(jax.random.fold_in(keys[i], j), (3,)) for i in range(k) for j in range(n))
    expected = expected.at[0].add(1.0)     # the rows' term: Σ x / Σ x over all micro-batches and shards
    np.testing.assert_allclose(np.asarray(grads), np.asarray(expected), rtol=1e-6)
    assert float(sums["rows"]) == 16.0 and float(loss) == 0.0


@pytest.mark.slow
def test_tiny_model_overfits_a_fixed_batch():
    config = tiny_config(global_batch_size=8, num_train_steps=100)
    config.optim.learning_rate = 5e-3
    config.optim.warmup_steps = 5
    config.model.hidden_dropout_prob = 0.0
    config.model.attention_probs_dropout_prob = 0.0
    s = _setup(config, dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    step = make_train_step(s["model"], s["step_cfg"], s["tx"], s["schedule"], step_lib.teacher_of(s["model"]))
    batch = _batch(config, 0, s["model"], s["special"])
    state, losses = s["state"], []
    with jax.set_mesh(s["mesh"]), nn.logical_axis_rules(s["rules"]):
        fn = jax.jit(lambda st, t, b: step(st, t, b, jax.random.key(0)))
        b = {k: jax.numpy.asarray(v) for k, v in batch.items()}
        for _ in range(config.num_train_steps):
            # The same masks every step too: a fixed key without the step folded in is not what
            # training does, so re-fold with step 0 by resetting the state's step counter.
            state, m = fn(state.replace(step=state.step * 0), s["teacher"], b)
            losses.append(float(m["mlm_loss"]))
    assert losses[-1] < losses[0] / 4, (losses[0], losses[-1])


@pytest.mark.slow
def test_loop_runs_and_logs_every_step(tmp_path, caplog):
    config = tiny_config(num_train_steps=4, log_every=1)
    config.checkpoint.every = 2
    with caplog.at_level("INFO", logger="tacl_jax.train"):
        out = loop.train_and_evaluate(config, str(tmp_path))
    # Synthetic ids have no held-out text: the end-of-training analysis says so and is skipped.
    assert "analysis skipped: no held-out sentences (config.data.source='synthetic'" in caplog.text
    assert not (tmp_path / "analysis").exists()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_mlm_loss" in r]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [4] and np.isfinite(evals[0]["eval_mlm_loss"])
    assert (tmp_path / "export" / "final" / "model.safetensors").is_file()
    assert all(np.isfinite(r["loss"]) for r in rows)
    np.testing.assert_allclose(rows[-1]["loss"], rows[-1]["mlm_loss"] + rows[-1]["tacl_loss"], rtol=1e-5)
    assert int(out["state"].step) == 4


@pytest.mark.parametrize("overrides,match", [
    (dict(global_batch_size=12), "not divisible by the data-parallel size 8"),
    (dict(max_len=100), "exceeds the model's max_position_embeddings"),
    (dict(**{"mesh.data": 3}), "mesh"),
    (dict(**{"init.from_scratch": False}), "pretrained teacher"),
    (dict(grad_accum_steps=3), "not divisible by grad_accum_steps"),
    (dict(**{"init.hf_path": "/nonexistent/bert-base-uncased"}), "bert-base-uncased' does not exist"),
    (dict(**{"data.source": "text:/nonexistent/corpus.txt"}), "corpus.txt"),
    (dict(**{"tacl.teacher_param_dtype": "fp16"}), "teacher_param_dtype='fp16': use one of"),
    # Out of range (every key's range: tests/test_config.py); these used to train, or to fail only
    # after compiling.
    (dict(**{"optim.b2": 1.5}), r"config.optim.b2=1.5 is out of range: must be in \[0, 1\)"),
    (dict(log_every=0), r"config.log_every=0 is out of range: must be >= 1"),
    (dict(**{"masking.max_predictions": 33}), r"max_predictions=33 is out of range: must be in \[0, max_len=32\]"),
])
def test_startup_validation_errors(tmp_path, overrides, match):
    config = tiny_config(**overrides)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        loop.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()   # refused before anything is written


@pytest.mark.slow
def test_non_finite_loss_stops_with_a_clear_message(tmp_path):
    config = tiny_config(num_train_steps=6)
    config.optim.learning_rate = 1e9   # diverges; config.validate refuses a NaN learning rate itself
    config.optim.warmup_fraction = 0.0
    with pytest.raises(loop.NonFiniteLossError, match="non-finite loss|diverged"):
        loop.train_and_evaluate(config, str(tmp_path))


@pytest.mark.slow
def test_remat_policies_leave_loss_and_grads_unchanged():
    config = tiny_config(global_batch_size=8)
    batch = None
    results = {}
    for policy in ("none", "full", "save_dots"):
        config.model.remat_policy = policy
        s = _setup(config, dict(data=2, fsdp=1, tensor=1), jax.devices()[:2])
        batch = batch or _batch(config, 1, s["model"], s["special"])
        results[policy] = _grads(s, batch)
    for policy in ("full", "save_dots"):
        np.testing.assert_allclose(results[policy][0], results["none"][0], rtol=1e-6)
        _assert_trees_close(results[policy][2], results["none"][2], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_profile_steps_trace_the_window_and_bad_values_are_refused(tmp_path, caplog):
    import gzip

    for bad, match in [("3,1", "STOP 1 must be greater than START 3"), ("-1,2", "START -1 is negative"),
                       ("a,b", "is not two integers"), ("2", "is not two integers"),
                       ("1.5,3", "is not two integers"), ("1,99", "past the run's last step")]:
        workdir = tmp_path / f"bad_{bad}"
        with pytest.raises(ValueError, match=f"config.profile_steps=.*{match}"):
            loop.train_and_evaluate(tiny_config(num_train_steps=4, profile_steps=bad), str(workdir))
        assert not workdir.exists()   # refused before anything is written

    config = tiny_config(num_train_steps=4, log_every=1, profile_steps="1,3", eval_at_end=False,
                         export_at_end=False, **{"analysis.enabled": False})
    with caplog.at_level("INFO", logger="tacl_jax.train"):
        out = loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert out["status"] == "finished" and int(out["state"].step) == 4
    profile = tmp_path / "run" / "profile"
    assert len(list(profile.rglob("*.xplane.pb"))) == 1, sorted(profile.rglob("*"))
    perfetto, = profile.rglob("perfetto_trace.json.gz")
    assert f"profile: training steps 2..3 (state step 1 -> 3) traced -> {profile}" in caplog.text
    assert str(perfetto) in caplog.text and "ui.perfetto.dev" in caplog.text
    events = json.loads(gzip.open(perfetto).read())["traceEvents"]
    # The two profiled steps: two executions of the jitted step ...
    runs = [e["args"]["run_id"] for e in events
            if e.get("name") == "CommonPjRtLoadedExecutable::Execute (jit_train_step)"]
    assert len(runs) == 2, sorted({e.get("name", "") for e in events if "train_step" in e.get("name", "")})
    # ... and their XLA ops (fusions of the step's HLO module) in the trace, the last step's included:
    # the trace waited for its device work.
    ops = [e for e in events
           if e.get("args", {}).get("hlo_module") == "jit_train_step" and "fusion" in e.get("name", "")]
    assert set(runs) <= {e["args"]["run_id"] for e in ops}, (runs, len(ops))
    # The one-step-late metrics are intact around the window.
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
