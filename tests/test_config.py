"""The config's start-up checks: every numeric key's range, resuming with a changed config, and
unknown keys on the command line (pure: nothing trains)."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from tacl_jax import config as config_lib
from tacl_jax.config import (CHECKS, DELEGATED_CHECKS, RESUME_RULES, ConfigChangedError, OneOf, Range,
                             default_config, load_config_file, resume_changes, resume_rule, unknown_key,
                             validate)

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The pre-training configs; configs/finetune*.py are tacl_jax.finetune's (tests/test_finetune.py).
CONFIG_FILES = sorted(p for p in (ROOT / "configs").glob("*.py") if not p.name.startswith("finetune"))


def tiny(**overrides):
    c = load_config_file(str(ROOT / "configs" / "tiny.py"))
    for path, value in overrides.items():
        _set(c, path, value)
    return c


def _set(c, path, value):
    *parents, last = path.split(".")
    for p in parents:
        c = c[p]
    c[last] = value


def _leaves(node, prefix=""):
    for key, value in node.items():
        if hasattr(value, "items"):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----------------------------------------------------------------------------- ranges

@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_configs_pass_validation(path):
    validate(load_config_file(str(path)))


def _diff(a, b):
    fa, fb = dict(_leaves(a)), dict(_leaves(b))
    return {k: (fa.get(k), fb.get(k)) for k in set(fa) | set(fb) if fa.get(k) != fb.get(k)}


@pytest.mark.parametrize("preset", ["tpu_v4_8.py", "tpu_v5e_16.py", "gpu_8xh100.py"])
def test_hardware_presets_are_the_base_recipe(preset):
    """A hardware preset is ``configs/base.py`` as it is (the default mesh, data=-1, spreads the
    batch over whatever devices the host has); only the checkpoints it keeps differ."""
    base = load_config_file(str(ROOT / "configs" / "base.py"))
    assert _diff(base, load_config_file(str(ROOT / "configs" / preset))) == {"checkpoint.keep_every": (0, 50_000)}


def test_coco_lm_tiny_is_the_coco_lm_recipe_small():
    """``coco_lm_tiny.py`` keeps ``coco_lm_base.py``'s loss, masking and optimizer."""
    diff = _diff(load_config_file(str(ROOT / "configs" / "coco_lm_base.py")),
                 load_config_file(str(ROOT / "configs" / "coco_lm_tiny.py")))
    assert not {k for k in diff if k.startswith(("masking.", "loss_weights.", "objective"))}
    assert not {k for k in diff if k.startswith("optim.")} - {"optim.learning_rate", "optim.warmup_steps"}
    assert not {k for k in diff if k.startswith("coco_lm.")} - {"coco_lm.generator_layers", "coco_lm.scl_group_size"}


def test_default_config_passes_every_check():
    c = default_config()
    c.init.from_scratch = True   # the one combination the defaults leave to the user: TaCL's teacher
    validate(c)


def test_every_numeric_key_has_a_range():
    """A numeric key added without an entry in CHECKS (or DELEGATED_CHECKS) fails here, as does an
    entry for a key that no longer exists."""
    configs = [default_config()] + [load_config_file(str(p)) for p in CONFIG_FILES]
    missing = sorted({path for c in configs for path, v in _leaves(c)
                      if _is_number(v) and path not in CHECKS and path not in DELEGATED_CHECKS})
    assert not missing, f"numeric config keys without a range in tacl_jax.config.CHECKS: {missing}"
    paths = {path for path, _ in _leaves(default_config())}
    assert not (set(CHECKS) | DELEGATED_CHECKS) - paths


def _out_of_range(check: Range, default, c):
    """Values just outside ``check`` (ints for int keys: ConfigDict keeps a key's type)."""
    step = 1 if isinstance(default, int) else 0.5
    bad = []
    for bound, is_open, sign in ((check.lo, check.lo_open, -1), (check.hi, check.hi_open, 1)):
        if bound is None:
            continue
        value = config_lib._bound(bound, c)
        value = value if is_open else value + sign * step
        while value in check.also:
            value += sign * step
        bad.append(type(default)(value))
    return bad


def test_every_range_is_enforced():
    """For each key of CHECKS, a value just past each bound is refused with the key, the value and
    the allowed range in the message; a choice outside OneOf likewise."""
    base = tiny()
    tried = 0
    for path, check in CHECKS.items():
        default = config_lib._get(base, path)
        bad = ["no-such-choice"] if isinstance(check, OneOf) else _out_of_range(check, default, base)
        if isinstance(check, OneOf) and _is_number(default):
            bad = [max(check.choices) + 1]
        for value in bad:
            c = tiny()
            _set(c, path, value)
            with pytest.raises(ValueError) as e:
                validate(c)
            assert f"config.{path}={value!r}" in str(e.value), (path, value, str(e.value))
            assert check.describe(c) in str(e.value), (path, str(e.value))
            tried += 1
        if isinstance(check, Range) and isinstance(default, float):
            for value in (math.nan, math.inf):
                c = tiny()
                _set(c, path, value)
                with pytest.raises(ValueError, match=rf"config\.{path}={value!r} is out of range: must be finite"):
                    validate(c)
    assert tried > len(CHECKS)


@pytest.mark.parametrize("path,value,message", [
    # The cases: these trained to exit 0, or failed only after compiling.
    ("optim.learning_rate", -1e-3, r"config.optim.learning_rate=-0.001 is out of range: must be >= 0"),
    ("optim.b2", 1.5, r"config.optim.b2=1.5 is out of range: must be in [0, 1)"),
    ("optim.warmup_fraction", 5.0, r"config.optim.warmup_fraction=5.0 is out of range: must be in [0, 1]"),
    ("log_every", 0, r"config.log_every=0 is out of range: must be >= 1"),
    ("masking.max_predictions", 33, r"config.masking.max_predictions=33 is out of range: must be in [0, max_len=32]"),
    ("optim.warmup_steps", -2, r"config.optim.warmup_steps=-2 is out of range: must be >= 0 or -1"),
    ("mesh.fsdp", 0, r"config.mesh.fsdp=0 is out of range: must be >= 1 or -1"),
    ("distributed.process_id", 1,
     r"config.distributed.process_id=1 is out of range: must be in [0, distributed.num_processes=1)"),
    ("analysis.max_len", 2, r"config.analysis.max_len=2 is out of range: must be >= 3 (when analysis.enabled)"),
    ("model.dropout_bits", 8, r"config.model.dropout_bits=8: use one of (16, 32)"),
    ("objective", "bert", r"config.objective='bert': use one of ('tacl', 'mlm', 'coco_lm')"),
    # checked by tacl_jax.data.config.validate
    ("data.short_seq_prob", 1.5, r"config.data.short_seq_prob=1.5 must be in [0, 1]"),
    ("data.eval_fraction", 1.0, r"config.data.eval_fraction=1.0 must be in [0, 1)"),
    ("data.num_shards", 0, r"config.data.num_shards=0 must be >= 1"),
    ("data.worker_count", -1, r"config.data.worker_count=-1 must be >= 0"),
    ("data.read_threads", -1, r"config.data.read_threads=-1 must be >= 0"),
    ("data.prefetch", -1, r"config.data.prefetch=-1 must be >= 0"),
])
def test_bad_values_are_refused_with_key_value_and_range(path, value, message):
    with pytest.raises(ValueError) as e:
        validate(tiny(**{path: value}))
    assert str(e.value) == message


@pytest.mark.parametrize("overrides", [
    {"optim.warmup_steps": -1, "data.first_regular_id": -1, "mesh.data": -1},   # the sentinels
    {"optim.learning_rate": 0.0, "optim.clip_norm": 0.0, "masking.max_predictions": 32},   # the bounds
    {"analysis.enabled": False, "analysis.num_sentences": 0},   # checked only while enabled
    {"distributed.num_processes": 4, "distributed.process_id": 3},
])
def test_values_at_the_edges_pass(overrides):
    validate(tiny(**overrides))


@pytest.mark.parametrize("overrides,message", [
    ({"masking.replace_prob": 0.9, "masking.random_prob": 0.2}, "replace_prob + random_prob = 0.9 + 0.2 > 1"),
    ({"mesh.data": -1, "mesh.fsdp": -1}, "at most one axis may be -1"),
    ({"global_batch_size": 8, "grad_accum_steps": 3}, "not divisible by grad_accum_steps 3"),
    ({"objective": "coco_lm", "masking.budget": "tacl"}, "masking.budget='tacl' is not wired into the COCO-LM step"),
])
def test_combinations_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        validate(tiny(**overrides))


# ----------------------------------------------------------------------------- resuming

def saved_of(c):
    """What the checkpoint stores: the JSON of the config it ran with."""
    return json.loads(c.to_json_best_effort())


@pytest.mark.parametrize("overrides,refused,warned", [
    ({}, [], []),
    ({"objective": "mlm"}, ['objective: "tacl" -> "mlm"'], []),
    ({"optim.learning_rate": 0.5}, [], ["optim.learning_rate: 0.001 -> 0.5"]),
    ({"objective": "mlm", "optim.learning_rate": 0.5, "log_every": 3},
     ['objective: "tacl" -> "mlm"'], ["optim.learning_rate: 0.001 -> 0.5"]),
    ({"seed": 1}, ["seed: 0 -> 1"], []),
    ({"nsp": True}, ["nsp: false -> true"], []),
    ({"model.hidden_dropout_prob": 0.0}, ["model.hidden_dropout_prob: 0.1 -> 0.0"], []),
    ({"model.scan_layers": True}, ["model.scan_layers: false -> true"], []),
    ({"model.dtype": "bfloat16"}, [], ['model.dtype: "float32" -> "bfloat16"']),
    ({"model.remat_policy": "full", "model.gather_last_layer": False, "optim.fused": False}, [], []),
    ({"masking.mask_prob": 0.2}, ["masking.mask_prob: 0.15 -> 0.2"], []),
    ({"masking.budget": "tacl"}, ['masking.budget: "bert" -> "tacl"'], []),
    ({"tacl.temperature": 0.1}, ["tacl.temperature: 0.01 -> 0.1"], []),
    ({"tacl.teacher_param_dtype": "float32"}, [], ['tacl.teacher_param_dtype: "compute" -> "float32"']),
    ({"loss_weights.tacl": 0.5}, ["loss_weights.tacl: 1.0 -> 0.5"], []),
    ({"coco_lm.loss_weights.binary": 10.0}, ["coco_lm.loss_weights.binary: 50.0 -> 10.0"], []),
    ({"init.scratch.hidden_size": 64}, ["init.scratch.hidden_size: 32 -> 64"], []),
    ({"init.hf_path": "/models/bert"}, ['init.hf_path: "" -> "/models/bert"'], []),
    ({"init.from_scratch": False, "init.params_from": "/runs/other"}, [], []),
    ({"num_train_steps": 200, "global_batch_size": 16, "max_len": 64}, [],
     ["max_len: 32 -> 64", "global_batch_size: 8 -> 16", "num_train_steps: 100 -> 200"]),
    ({"data.source": "builtin:python_docs", "data.worker_count": 2}, [],
     ['data.source: "synthetic" -> "builtin:python_docs"']),
    ({"grad_accum_steps": 2, "steps_per_run": 5, "log_every": 1, "eval_every": 5, "eval_at_end": False,
      "eval_batches": 1, "hf_export_every": 5, "export_at_end": False, "demo_fill_mask": "a [MASK]",
      "profile_steps": "1,2", "mesh.data": 2, "mesh_devices": 2, "distributed.num_processes": 2,
      "checkpoint.every": 1, "checkpoint.keep": 9, "metrics.peak_flops_per_device": 1e12,
      "analysis.enabled": False}, [], []),
])
def test_resume_changes(overrides, refused, warned):
    saved = saved_of(tiny())
    assert resume_changes(saved, tiny(**overrides)) == (refused, warned)


def test_resume_with_pretrained_paths():
    saved = saved_of(tiny(**{"init.hf_path": "/a/bert", "init.scratch.hidden_size": 64}))
    # Both pretrained: the architecture is the HF folder's, init.scratch does not matter; a new path
    # may be the same model moved, so it is warned, not refused.
    now = tiny(**{"init.hf_path": "/b/bert", "init.tokenizer_path": "/b/bert"})
    refused, warned = resume_changes(saved, now)
    assert refused == []
    assert warned == ['init.hf_path: "/a/bert" -> "/b/bert" (the same model moved? it is read from the new path)',
                      'init.tokenizer_path: "" -> "/b/bert"']
    # Dropping the pretrained teacher is another training problem.
    refused, _ = resume_changes(saved, tiny())
    assert refused == ['init.hf_path: "/a/bert" -> ""', "init.scratch.hidden_size: 64 -> 32"]


def test_resume_compares_json_round_tripped_values():
    """A saved config went through JSON: tuples are lists, 1e-4 was written 0.0001, and an int key
    may come back as a float; none of that is a change. True is not 1."""
    c = tiny(**{"optim.learning_rate": 1e-4, "logical_axis_rules": (("batch", ("data", "fsdp")),)})
    saved = saved_of(c)
    assert saved["logical_axis_rules"] == [["batch", ["data", "fsdp"]]]
    saved["checkpoint"]["every"] = 1000.0
    saved["optim"]["learning_rate"] = json.loads("0.0001")
    saved["metrics"]["peak_flops_per_device"] = 0
    assert resume_changes(saved, c) == ([], [])
    saved["nsp"] = 0
    assert resume_changes(saved, c) == (["nsp: 0 -> false"], [])


def test_resume_tolerates_keys_of_another_version():
    c = tiny()
    saved = saved_of(c)
    del saved["optim"]["fused"]                 # written before the key existed: not compared
    del saved["coco_lm"]                        # a whole group, too
    saved["optim"]["nesterov"] = True           # a key this version removed
    saved["retired_group"] = {"x": 1}
    saved["mesh"] = "data=8"                    # a value then, a group now
    assert resume_changes(saved, c) == ([], [])
    assert resume_changes({}, c) == resume_changes(None, c) == ([], [])


def test_refusal_is_one_error_with_every_change_and_the_way_out():
    refused, warned = resume_changes(saved_of(tiny()), tiny(objective="mlm", **{"masking.mask_prob": 0.2,
                                                                                "optim.b1": 0.8}))
    assert warned == ["optim.b1: 0.9 -> 0.8"]
    e = ConfigChangedError(refused, "/runs/a")
    assert isinstance(e, ValueError) and e.refused == refused and "\n" not in str(e)
    assert str(e).startswith('/runs/a holds a checkpoint trained with another config, which a resumed run '
                             'cannot change: objective: "tacl" -> "mlm"; masking.mask_prob: 0.15 -> 0.2. ')
    assert "Use a new --workdir, or a new --workdir with --config.init.params_from=/runs/a" in str(e)


def test_every_key_has_a_resume_rule():
    """A key added to default_config() must be classified (refused / warned / neither) for resume."""
    paths = [path for path, _ in _leaves(default_config())]
    assert not [p for p in paths if resume_rule(p) is None]
    assert all(any(p == k or p.startswith(k + ".") for p in paths) for k in RESUME_RULES)


# ----------------------------------------------------------------------------- unknown keys

@pytest.mark.parametrize("path,message", [
    ("optim.learning_rate", None),
    ("init.scratch.hidden_size", None),
    ("optim.lr", "unknown config key optim.lr; did you mean optim.learning_rate? (keys of optim: b1, b2, "
                 "clip_norm, eps, fused, learning_rate, warmup_fraction, warmup_steps, weight_decay)"),
    ("optim.learning_rat", "unknown config key optim.learning_rat; did you mean optim.learning_rate? ("),
    ("optim.warmup", "did you mean optim.warmup_steps or optim.warmup_fraction?"),
    ("init.scratch.hidden_sise", "unknown config key init.scratch.hidden_sise; did you mean "
                                 "init.scratch.hidden_size? (keys of init.scratch: hidden_size, "),
    ("lg_every", "unknown config key lg_every; did you mean log_every"),
    ("learning_rate", "unknown config key learning_rate; did you mean optim.learning_rate? (keys of config: "),
    ("temperature", "did you mean coco_lm.temperature or tacl.temperature?"),
    ("optimx.lr", "unknown config key optimx.lr; did you mean optim? (keys of config: "),
    ("max_len.x", "unknown config key max_len.x: config.max_len is a value (32), not a group of keys; "
                  "override it with --config.max_len=..."),
    ("zzz", "unknown config key zzz (keys of config: analysis, "),
])
def test_unknown_key_names_the_path_and_the_nearest_keys(path, message):
    got = unknown_key(tiny(), path)
    if message is None:
        assert got is None
    else:
        assert message in got and "\n" not in got


@pytest.mark.slow
def test_unknown_config_key_is_refused_by_the_cli(tmp_path):
    """One process for every case: the nested and top-level typos are all reported, one line
    each, before anything starts."""
    workdir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "tacl_jax.main", f"--config={ROOT / 'configs' / 'tiny.py'}",
                        f"--workdir={workdir}", "--config.optim.learning_rat=1e-3", "--config.optim.lr=1",
                        "--config.lg_every=1", "--config.max_len=16"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("FATAL Flags parsing error:")]
    assert len(lines) == 3, p.stderr[-3000:]
    assert "unknown config key optim.learning_rat; did you mean optim.learning_rate?" in lines[0]
    assert "unknown config key optim.lr; did you mean optim.learning_rate? (keys of optim: " in lines[1]
    assert "unknown config key lg_every; did you mean log_every" in lines[2]
    assert not workdir.exists()
