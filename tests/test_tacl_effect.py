"""bench/tacl_effect.py's statistics (paired differences, sign counts) against numpy on made-up
per-seed results, its arms and its corpus split."""

import os

import numpy as np
import pytest
from bench_module import BENCH, load_bench



@pytest.fixture(scope="module")
def tacl_effect():
    return load_bench("tacl_effect")


def _result(rng, layers=3):
    r = {k: [float(v) for v in rng.uniform(0, 1, layers)] for k in ("self_similarity", "top_pc_share")}
    r.update(heldout_mlm_acc=float(rng.uniform(0, 0.4)), heldout_mlm_loss=float(rng.uniform(4, 11)))
    return r


def test_summary_matches_numpy(tacl_effect):
    rng = np.random.default_rng(0)
    names = ("init", "mlm", "tacl", "tau=0.1", "peer:mlm", "peer:tacl")
    per_seed = {s: {n: _result(rng) for n in names} for s in (0, 3, 7)}
    s = tacl_effect.summarize(per_seed)
    assert s["seeds"] == [0, 3, 7]
    for name in names:
        for k, (measure, layer) in {"self_similarity@last": ("self_similarity", -1),
                                    "top_pc_share@1": ("top_pc_share", 1)}.items():
            v = np.array([r[name][measure][layer] for r in per_seed.values()])
            assert s["models"][name][k]["mean"] == pytest.approx(v.mean(), abs=1e-12)
            assert s["models"][name][k]["sd"] == pytest.approx(v.std(ddof=1), abs=1e-12)
            assert s["models"][name][k]["n"] == 3
    assert set(s["minus_baseline"]) == {"tacl", "tau=0.1", "peer:tacl"}     # init and the baselines unpaired
    for name, base in (("tacl", "mlm"), ("tau=0.1", "mlm"), ("peer:tacl", "peer:mlm")):
        d = np.array([r[name]["self_similarity"][-1] - r[base]["self_similarity"][-1] for r in per_seed.values()])
        got = s["minus_baseline"][name]["self_similarity@last"]
        assert got["mean"] == pytest.approx(d.mean(), abs=1e-12)
        assert got["sd"] == pytest.approx(d.std(ddof=1), abs=1e-12)
        assert got["per_seed"][3] == pytest.approx(d[1])
        assert got["lower"] == f"{int((d < 0).sum())} of 3"
    acc = [r["tacl"]["heldout_mlm_acc"] - r["mlm"]["heldout_mlm_acc"] for r in per_seed.values()]
    assert s["minus_baseline"]["tacl"]["heldout_mlm_acc"]["mean"] == pytest.approx(np.mean(acc), abs=1e-12)


def test_summary_counts_seeds_lower_and_skips_missing_models(tacl_effect):
    def res(mlm, tacl):
        return dict(mlm=dict(self_similarity=[0.5, mlm]), tacl=dict(self_similarity=[0.5, tacl]))

    per_seed = {0: res(0.24, 0.22), 1: res(0.25, 0.26), 2: res(0.30, 0.20)}
    per_seed[1]["tau=0.1"] = dict(self_similarity=[0.5, 0.1])       # only one seed has it: left out
    s = tacl_effect.summarize(per_seed)
    d = s["minus_baseline"]["tacl"]["self_similarity@last"]
    assert d["lower"] == "2 of 3"
    assert d["mean"] == pytest.approx((-0.02 + 0.01 - 0.10) / 3)
    assert "tau=0.1" not in s["models"]


def test_summary_takes_a_measure_over_the_seeds_that_have_it(tacl_effect):
    per_seed = {0: dict(mlm=dict(heldout_mlm_acc=0.4), tacl=dict(heldout_mlm_acc=0.3)),
                1: dict(mlm=dict(heldout_mlm_acc=0.5, anchor_tacl_loss=2.0),
                        tacl=dict(heldout_mlm_acc=0.45, anchor_tacl_loss=1.5)),
                2: dict(mlm=dict(heldout_mlm_acc=0.5, anchor_tacl_loss=3.0),
                        tacl=dict(heldout_mlm_acc=0.40, anchor_tacl_loss=3.5))}
    s = tacl_effect.summarize(per_seed)
    assert s["models"]["tacl"]["anchor_tacl_loss"] == dict(mean=2.5, sd=pytest.approx(np.std([1.5, 3.5], ddof=1)), n=2)
    d = s["minus_baseline"]["tacl"]["anchor_tacl_loss"]
    assert d["per_seed"] == {1: -0.5, 2: 0.5} and d["lower"] == "1 of 2"
    assert s["minus_baseline"]["tacl"]["heldout_mlm_acc"]["n"] == 3


def test_arms_parse_and_refuse_unknown(tacl_effect):
    assert tacl_effect.arm_spec("tau=0.05") == ("tacl", {"tacl.temperature": 0.05})
    assert tacl_effect.arm_spec("tacl_only") == ("tacl", {"loss_weights.mlm": 0.0})
    with pytest.raises(SystemExit, match="unknown arm 'tacll'"):
        tacl_effect.arm_spec("tacll")


def test_arm_overrides_are_valid_config_keys(tacl_effect):
    """Every arm's overrides land on existing keys and pass the config's validation."""
    import argparse

    from tacl_jax import config as config_lib

    args = argparse.Namespace(max_len=64, batch=16, lr=1e-4)
    for arm in list(tacl_effect.ARMS) + ["tau=0.1"]:
        objective, overrides = tacl_effect.arm_spec(arm)
        c = tacl_effect.make_config(objective, overrides, init="/x", train="/y.txt", steps=10, args=args, seed=0)
        for key, value in overrides.items():
            node = c
            for part in key.split("."):
                node = node[part]
            assert node == value
        config_lib.validate(c)


def test_split_corpus_cuts_at_a_heading_near_the_middle(tacl_effect, tmp_path):
    lines = []
    for a in range(6):
        lines += [f" = Article {a} = ", ""] + [f" sentence {a} {i} ." for i in range(10 * (a + 1))] + [""]
    src = tmp_path / "wiki.txt"
    src.write_text("\n".join(lines))
    first, second = tacl_effect.split_corpus(str(src), str(tmp_path / "out"))
    a, b = open(first).read(), open(second).read()
    assert b.startswith(" = Article 4 = ")             # articles 0-3: 100 lines, 4-5: 110 lines
    assert a.split("\n")[:-1] + b.split("\n")[:-1] == lines


def test_the_peers_number_is_its_last_layer_self_similarity(tacl_effect):
    per_seed = {0: {"mlm": dict(self_similarity=[0.3, 0.17]), "tacl": dict(self_similarity=[0.3, 0.29]),
                    "peer:mlm": dict(last_layer_self_similarity=0.172),
                    "peer:tacl": dict(last_layer_self_similarity=0.289)}}
    s = tacl_effect.summarize(per_seed)
    assert s["minus_baseline"]["peer:tacl"]["self_similarity@last"]["mean"] == pytest.approx(0.117)
    assert "| peer:tacl | 0.289 ± 0.000 (Δ +0.117" in tacl_effect.table(s)


def test_each_peer_arm_reaches_the_peer_as_its_settings(tacl_effect, monkeypatch):
    """The peer's command line for every arm it runs, parsed by bench/torch_peer.py itself."""
    pytest.importorskip("torch")  # in the test extras; never skipped in CI
    peer = load_bench("torch_peer")
    assert tacl_effect.PEER == str(BENCH / "torch_peer.py")     # the default peer: the repo's own
    args = tacl_effect.parse_args(["--out=/tmp/effect_x", "--init=/m", "--steps=900", "--seeds=3"])
    args.train, args.seed = "/s2.txt", 3
    want = {"mlm": ("mlm", 1.0, "masked", False, 0.01), "tacl": ("tacl", 1.0, "masked", False, 0.01),
            "tacl_only": ("tacl", 0.0, "masked", False, 0.01), "teacher_dropout": ("tacl", 1.0, "masked", True, 0.01),
            "all_positions": ("tacl", 1.0, "all", False, 0.01), "tau=0.1": ("tacl", 1.0, "masked", False, 0.1)}
    assert set(want) - {"tau=0.1"} == set(tacl_effect.PEER_ARMS)
    for arm, (objective, mlm_weight, anchors, dropout, tau) in want.items():
        a = peer.parse_args(tacl_effect.peer_command(args, arm)[2:])
        assert (a.objective, a.mlm_weight, a.anchors, a.teacher_dropout, a.tau) == (objective, mlm_weight, anchors,
                                                                                   dropout, tau), arm
        assert (a.init, a.train, a.steps, a.seed, a.measure_every) == ("/m", "/s2.txt", 900, 3, 0)
    args.measure_every = 300
    assert peer.parse_args(tacl_effect.peer_command(args, "tacl")[2:]).measure_every == 300
    with pytest.raises(SystemExit, match=r"no arm 'keep_pad_keys'.*no \[PAD\] keys"):
        tacl_effect.peer_command(args, "keep_pad_keys")
    assert peer.parse_args(tacl_effect.peer_command(args, "tacl")[2:]).device == "cpu"
    args.peer_device = "cuda"                   # --peer_device: the peer's own --device
    assert peer.parse_args(tacl_effect.peer_command(args, "tacl")[2:]).device == "cuda"


def test_empty_arms_measure_the_init_only(tacl_effect):
    args = tacl_effect.parse_args(["--out=/tmp/effect_x", "--arms="])
    assert [a for a in args.arms.split(",") if a] == []
    with pytest.raises(SystemExit, match="unknown arm 'x'"):
        tacl_effect.parse_args(["--out=/tmp/effect_x", "--arms=mlm,x"])


def test_stage1_trains_the_fixed_init_config(tacl_effect, tmp_path, monkeypatch):
    """Stage 1 from a fresh --out (no seed chosen yet): MLM, seed 0, 16 × 64, exported, no trajectory."""
    from tacl_jax.train import loop

    seen = {}
    status = "finished"

    def train(c, workdir):
        seen.update(c=c, workdir=workdir)
        return {"status": status}

    monkeypatch.setattr(loop, "train_and_evaluate", train)
    args = tacl_effect.parse_args([f"--out={tmp_path}", "--max_len=128", "--batch=4", "--measure_every=100"])
    args.minilm, args.stage1_train = "/minilm", "/stage1.txt"
    export = tacl_effect.stage1(args)
    c = seen["c"]
    assert export == str(tmp_path / "stage1" / "export" / "final") and seen["workdir"] == str(tmp_path / "stage1")
    assert (c.objective, c.seed, c.max_len, c.global_batch_size, c.num_train_steps) == ("mlm", 0, 64, 16, 1500)
    assert c.export_at_end and c.hf_export_every == 0 and c.init.hf_path == "/minilm"
    assert (c.checkpoint.every, c.checkpoint.keep) == (250, 1)      # a stopped stage 1 resumes
    status = "preempted"        # SIGTERM: no export to hand on as the init
    with pytest.raises(SystemExit, match="stage 1 stopped before its last step .preempted.*rerun the same command"):
        tacl_effect.stage1(args)


class _State:
    params = {"w": 0.0}


class _Measure:
    """The measures of a model are its ``w``; an export's ``w`` is its step."""

    def params_of(self, folder):
        return {"w": float(folder.rsplit("_", 1)[1])}

    def __call__(self, params):
        return {"self_similarity": [params["w"]]}


def _arm_args(tacl_effect, tmp_path, *flags, seed=3):
    args = tacl_effect.parse_args([f"--out={tmp_path}", *flags])
    args.seed, args.init, args.train = seed, "/init", "/train.txt"
    return args


def test_run_arm_measures_the_exports_of_its_trajectory(tacl_effect, tmp_path, monkeypatch):
    from tacl_jax.train import loop

    seen = {}

    def train(c, workdir):
        for step in (300, 900):      # 600's export is missing (removed by hand)
            os.makedirs(os.path.join(workdir, "export", f"step_{step}"))
            open(os.path.join(workdir, "export", f"step_{step}", "config.json"), "w").close()
        seen.update(c=c)
        return {"state": _State(), "metrics": {"loss": 1.0}, "status": "finished"}

    monkeypatch.setattr(loop, "train_and_evaluate", train)

    args = _arm_args(tacl_effect, tmp_path, "--steps=1000", "--measure_every=300", seed=2)
    out = tacl_effect.run_arm(args, "tacl", _Measure(), str(tmp_path))
    assert seen["c"].hf_export_every == 300 and seen["c"].seed == 2 and seen["c"].num_train_steps == 1000
    assert out["self_similarity"] == [0.0]
    assert out["trajectory"] == {str(s): {"self_similarity": [float(s)]} for s in (300, 900)}
    assert out["resumed_from"] is None
    assert not os.path.exists(tmp_path / "run_tacl")           # the run folder (and its exports) deleted


def _checkpoint_of(tacl_effect, args, arm: str, workdir: str, step: int) -> None:
    """A real checkpoint of ``arm``'s config as run with ``args``, at ``step``."""
    from tacl_jax import checkpoint

    objective, overrides = tacl_effect.arm_spec(arm)
    c = tacl_effect.make_config(objective, overrides, init=args.init, train=args.train, steps=args.steps,
                                args=args, seed=args.seed)
    ckpt = checkpoint.CheckpointManager(workdir, c.checkpoint)
    ckpt.save(step, {"w": np.zeros(3, np.float32)}, {"pos": step}, c, force=True)
    ckpt.wait()
    ckpt.close()


def test_an_interrupted_arm_resumes_only_with_the_same_settings(tacl_effect, tmp_path, monkeypatch):
    """Its run folder is kept when its checkpoint was written with this very config (the loop then
    resumes it), and deleted when written with other settings (here another --steps)."""
    from tacl_jax.train import loop

    seen = []

    def train(c, workdir):
        seen.append(sorted(os.listdir(os.path.join(workdir, "checkpoints"))) if os.path.isdir(workdir) else None)
        os.makedirs(workdir, exist_ok=True)
        return {"state": _State(), "metrics": {}, "status": "finished"}

    monkeypatch.setattr(loop, "train_and_evaluate", train)
    workdir = str(tmp_path / "run_tacl")
    args = _arm_args(tacl_effect, tmp_path, "--steps=1000")
    _checkpoint_of(tacl_effect, args, "tacl", workdir, 500)
    out = tacl_effect.run_arm(args, "tacl", _Measure(), str(tmp_path))
    assert seen == [["500"]] and out["resumed_from"] == 500

    _checkpoint_of(tacl_effect, _arm_args(tacl_effect, tmp_path, "--steps=2000"), "tacl", workdir, 500)
    out = tacl_effect.run_arm(args, "tacl", _Measure(), str(tmp_path))
    assert seen[1] is None and out["resumed_from"] is None       # deleted: another schedule

    _checkpoint_of(tacl_effect, args, "tau=0.1", workdir, 500)      # another arm's loss in this folder
    out = tacl_effect.run_arm(args, "tacl", _Measure(), str(tmp_path))
    assert seen[2] is None and out["resumed_from"] is None


def test_the_folder_of_an_arm_still_running_is_left_alone(tacl_effect, tmp_path, monkeypatch):
    """The same arm started twice: the second is refused, the first's folder is not deleted."""
    from tacl_jax import workdir as workdir_lib
    from tacl_jax.train import loop

    monkeypatch.setattr(loop, "train_and_evaluate", lambda c, workdir: pytest.fail("must not train"))
    workdir = tmp_path / "run_tacl"
    workdir.mkdir()
    (workdir / "events.txt").write_text("step 120")       # no checkpoint yet
    lock = workdir_lib.WorkdirLock(str(workdir)).acquire()
    try:
        with pytest.raises(SystemExit, match="another run holds this workdir"):
            tacl_effect.run_arm(_arm_args(tacl_effect, tmp_path), "tacl", _Measure(), str(tmp_path))
    finally:
        lock.release()
    assert (workdir / "events.txt").read_text() == "step 120"


def test_a_stopped_arm_records_nothing_and_keeps_its_checkpoint(tacl_effect, tmp_path, monkeypatch):
    from tacl_jax.train import loop

    def train(c, workdir):
        os.makedirs(os.path.join(workdir, "checkpoints", "250"))
        return {"state": None, "metrics": {}, "status": "preempted"}

    monkeypatch.setattr(loop, "train_and_evaluate", train)
    monkeypatch.setattr(tacl_effect, "Measurer", lambda args: _Measure())
    args = _arm_args(tacl_effect, tmp_path)
    seed_dir = tmp_path / "seed_3"
    seed_dir.mkdir()
    (seed_dir / "init.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"arm tacl of seed 3 stopped before its last step \(preempted\); "
                                         r"nothing was recorded.*rerun the same command to resume it"):
        tacl_effect.run_seed(args, ["tacl"])
    assert not (seed_dir / "tacl.json").exists() and (seed_dir / "run_tacl" / "checkpoints" / "250").is_dir()


def test_peer_only_runs_the_peer_and_reads_ours_from_the_cache(tacl_effect, tmp_path, monkeypatch):
    """--peer_only: tacl_jax's arms are never trained or measured; those already cached join the
    summary beside the peer's, which run (and are cached) as with --peer."""
    monkeypatch.setattr(tacl_effect, "Measurer", lambda args: pytest.fail("must not measure with tacl_jax"))
    monkeypatch.setattr(tacl_effect, "run_arm", lambda *a: pytest.fail("must not train a tacl_jax arm"))
    ran = []

    def peer(args, arm, seed_dir):
        ran.append(arm)
        return dict(last_layer_self_similarity={"init": 0.18, "mlm": 0.17, "tacl": 0.29}[arm])

    monkeypatch.setattr(tacl_effect, "run_peer", peer)
    args = _arm_args(tacl_effect, tmp_path, "--peer_only")
    seed_dir = tmp_path / "seed_3"
    seed_dir.mkdir()
    (seed_dir / "mlm.json").write_text('{"self_similarity": [0.5, 0.168]}')    # ours: mlm cached, tacl not
    res = tacl_effect.run_seed(args, ["mlm", "tacl"])
    assert ran == ["init", "mlm", "tacl"]
    assert set(res) == {"mlm", "peer:init", "peer:mlm", "peer:tacl"}
    assert not (seed_dir / "tacl.json").exists() and (seed_dir / "peer_tacl.json").is_file()
    s = tacl_effect.summarize({3: res})
    assert s["minus_baseline"]["peer:tacl"]["self_similarity@last"]["mean"] == pytest.approx(0.12)
    assert s["models"]["mlm"]["self_similarity@last"]["mean"] == pytest.approx(0.168)
    ran.clear()
    assert tacl_effect.run_seed(args, ["mlm", "tacl"]) == res and ran == []     # the second call: all cached


def test_dtype_and_packing_reach_the_config_and_a_cached_result_of_others_is_refused(tacl_effect, tmp_path,
                                                                                    monkeypatch):
    """--dtype sets model.dtype of every arm (default 'auto'), --packing its rows; a cached tacl_jax
    result computed in another dtype or on other rows stops the study with a message naming both
    (never a summary mixing bf16 and f32), one of the same or from before they were recorded is read."""
    defaults = tacl_effect.parse_args([f"--out={tmp_path}"])
    assert (defaults.dtype, defaults.packing) == ("auto", "full_sentences")
    c = tacl_effect.make_config("tacl", {}, init="/x", train="/y.txt", steps=10, args=defaults, seed=0)
    assert (c.data.packing, c.data.short_seq_prob) == ("full_sentences", 0.1)
    args = _arm_args(tacl_effect, tmp_path, "--dtype=float32", "--packing=contiguous")
    for arm in ("mlm", "tacl", "tau=0.1"):
        objective, overrides = tacl_effect.arm_spec(arm)
        c = tacl_effect.make_config(objective, overrides, init="/x", train="/y.txt", steps=10, args=args, seed=0)
        assert (c.model.dtype, c.data.packing, c.data.short_seq_prob) == ("float32", "contiguous", 0.0)
    monkeypatch.setattr(tacl_effect, "run_arm", lambda *a: pytest.fail("a cached arm must not be trained"))
    seed_dir = tmp_path / "seed_3"
    seed_dir.mkdir()
    (seed_dir / "init.json").write_text('{"self_similarity": [0.5, 0.18]}')                    # unrecorded: read
    (seed_dir / "mlm.json").write_text('{"self_similarity": [0.5, 0.17], "compute_dtype": "float32"}')
    (seed_dir / "tacl.json").write_text('{"self_similarity": [0.5, 0.29], "compute_dtype": "bfloat16"}')
    assert set(tacl_effect.run_seed(args, ["mlm"])) == {"init", "mlm"}
    with pytest.raises(SystemExit, match=r"tacl.json was computed in bfloat16, but --dtype=float32 computes in "
                                         r"float32 here: pass --dtype=bfloat16, or another --out"):
        tacl_effect.run_seed(args, ["mlm", "tacl"])
    args = _arm_args(tacl_effect, tmp_path, "--dtype=bfloat16", "--packing=contiguous")
    assert tacl_effect.run_seed(args, ["tacl"])["tacl"]["compute_dtype"] == "bfloat16"
    (seed_dir / "tacl.json").write_text('{"self_similarity": [0.5, 0.29], "packing": "full_sentences"}')
    with pytest.raises(SystemExit, match=r"tacl.json was trained with packing full_sentences, but this call asks "
                                         r"for --packing=contiguous: pass --packing=full_sentences, or another --out"):
        tacl_effect.run_seed(args, ["tacl"])


def test_eps_and_masking_budget_reach_stage_2_only_and_a_cached_arm_of_others_is_refused(tacl_effect, tmp_path,
                                                                                        monkeypatch):
    """--adam_eps and --masking_budget set optim.eps and masking.budget of every stage-2 arm (defaults:
    the config's 1e-8 and 'bert'); a cached arm trained with others — or, unrecorded, before the flags
    existed (so with the defaults) — is refused when the call asks for others; the init's measures
    (nothing trained) are read whatever the flags."""
    defaults = tacl_effect.parse_args([f"--out={tmp_path}"])
    c = tacl_effect.make_config("tacl", {}, init="/x", train="/y.txt", steps=10, args=defaults, seed=0)
    assert (c.optim.eps, c.masking.budget) == (1e-8, "bert")
    args = _arm_args(tacl_effect, tmp_path, "--adam_eps=1e-6", "--masking_budget=bernoulli")
    for arm in ("mlm", "tacl", "tacl_only"):
        objective, overrides = tacl_effect.arm_spec(arm)
        c = tacl_effect.make_config(objective, overrides, init="/x", train="/y.txt", steps=10, args=args, seed=0)
        assert (c.optim.eps, c.masking.budget) == (1e-6, "bernoulli")
    monkeypatch.setattr(tacl_effect, "run_arm", lambda *a: pytest.fail("a cached arm must not be trained"))
    seed_dir = tmp_path / "seed_3"
    seed_dir.mkdir()
    (seed_dir / "init.json").write_text('{"self_similarity": [0.5, 0.18]}')
    (seed_dir / "mlm.json").write_text('{"self_similarity": [0.5, 0.17], "adam_eps": 1e-06, '
                                       '"masking_budget": "bernoulli"}')
    (seed_dir / "tacl.json").write_text('{"self_similarity": [0.5, 0.29]}')          # from before: 1e-8, bert
    assert set(tacl_effect.run_seed(args, ["mlm"])) == {"init", "mlm"}
    with pytest.raises(SystemExit, match=r"tacl.json was trained with adam_eps 1e-08, but this call asks for "
                                         r"--adam_eps=1e-06: pass --adam_eps=1e-08, or another --out"):
        tacl_effect.run_seed(args, ["mlm", "tacl"])
    args = _arm_args(tacl_effect, tmp_path, "--adam_eps=1e-6")
    with pytest.raises(SystemExit, match=r"mlm.json was trained with masking_budget bernoulli, but this call asks "
                                         r"for --masking_budget=bert: pass --masking_budget=bernoulli"):
        tacl_effect.run_seed(args, ["mlm"])
    args = _arm_args(tacl_effect, tmp_path)
    assert set(tacl_effect.run_seed(args, ["tacl"])) == {"init", "tacl"}


def test_trajectory_summary_pairs_each_step_like_the_final_one(tacl_effect):
    rng = np.random.default_rng(1)

    def arm(steps):
        r = _result(rng)
        r["trajectory"] = {str(s): _result(rng) for s in steps}
        return r

    per_seed = {s: {"init": _result(rng), "mlm": arm((100, 200)), "tacl": arm((100, 200)), "tau=0.1": _result(rng)}
                for s in (0, 1, 2)}
    t = tacl_effect.trajectory_summary(per_seed, final_step=300)
    assert list(t) == [100, 200, 300]
    assert set(t[100]["models"]) == {"mlm", "tacl"}            # the init and an arm without a trajectory: left out
    for step in (100, 300):
        pick = (lambda r: r) if step == 300 else (lambda r: r["trajectory"][str(step)])
        d = np.array([pick(r["tacl"])["self_similarity"][-1] - pick(r["mlm"])["self_similarity"][-1]
                      for r in per_seed.values()])
        got = t[step]["minus_baseline"]["tacl"]["self_similarity@last"]
        assert got["mean"] == pytest.approx(d.mean(), abs=1e-12) and got["sd"] == pytest.approx(d.std(ddof=1), abs=1e-12)
    row = tacl_effect.trajectory_table(t).splitlines()[2]
    assert row.startswith("| 100 | ") and f"(Δ {t[100]['minus_baseline']['tacl']['self_similarity@last']['mean']:+.3f})" in row
    assert tacl_effect.trajectory_summary({0: {"mlm": _result(rng)}}, final_step=300) == {}
