"""The objective interface: the registry agrees with the config, every objective's eval step is its
train loss without dropout, and a new objective plugs in through a registry entry alone."""

import pathlib
import sys

import jax
import numpy as np
import pytest

from tacl_jax import config as config_lib
from tacl_jax.config import load_config_file, override
from tacl_jax.data import synthetic
from tacl_jax.train import objective, setup

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(name: str, **overrides):
    c = load_config_file(str(ROOT / "configs" / ("coco_lm_tiny.py" if name == "coco_lm" else "tiny.py")))
    c.objective = name
    c.global_batch_size = 4
    c.max_len = 16
    c.model.hidden_dropout_prob = 0.0          # eval == train only without dropout
    c.model.attention_probs_dropout_prob = 0.0
    return override(c, overrides)


def _batch(prog, step=0):
    c, special = prog.config, prog.special_ids
    return prog.global_batch(synthetic.global_batch(
        c.seed, step, c.global_batch_size, max_len=c.max_len, vocab_size=prog.model.config.vocab_size,
        first_regular_id=5, cls_id=special["cls"], sep_id=special["sep"], pad_id=special["pad"],
        short_seq_prob=0.3, with_nsp=c.nsp))


def test_registry_names_the_config_objectives():
    assert set(objective.REGISTRY) == set(config_lib.OBJECTIVES)
    for name in config_lib.OBJECTIVES:
        obj = objective.get(name)
        assert obj.name == name and isinstance(obj.console_keys, tuple) and obj.console_keys[0] == "loss"
    with pytest.raises(objective.UnknownObjectiveError, match="known: "):
        objective.get("electra")


@pytest.mark.parametrize("name", ["tacl", pytest.param("mlm", marks=pytest.mark.slow),
                                  pytest.param("coco_lm", marks=pytest.mark.slow)])
def test_eval_step_is_the_train_loss_without_dropout(name):
    """The eval step's sums at mask key r equal the train step's loss sums at a step key whose
    mask key is r (dropout off): one loss function serves both."""
    prog = setup.build_program(_config(name), jax.devices()[:1])
    state = prog.create_state()
    teacher = prog.create_teacher()
    assert (teacher is None) == (name == "coco_lm" or name == "mlm")
    batch = _batch(prog)
    step_rng = jax.random.key(3)
    mask_rng = jax.random.split(step_rng)[0]     # both steps split (mask/prep key, dropout key)
    if name == "coco_lm":
        from tacl_jax.train.coco_step import make_coco_loss_and_grads as lag
        lag = lag(prog.model, prog.step_cfg)
    else:
        from tacl_jax.train.step import make_loss_and_grads
        lag = make_loss_and_grads(prog.model, prog.step_cfg, prog.teacher_model)
    with jax.set_mesh(prog.mesh):
        _, train_sums, _ = jax.jit(lag)(state.params, teacher, batch, step_rng)
        eval_sums = prog.eval_step(state.params, teacher, batch, mask_rng)
    train_sums, eval_sums = jax.device_get((train_sums, eval_sums))
    assert set(train_sums) == set(eval_sums)
    for k in train_sums:
        np.testing.assert_allclose(eval_sums[k], train_sums[k], rtol=2e-5, atol=1e-5, err_msg=k)
    metrics = prog.eval_ratios(eval_sums)
    assert np.isfinite(metrics["mlm_loss" if name != "coco_lm" else "gen_mlm_loss"])


# A new objective, defined outside the package: MLM whose reported metrics carry its own name.
class _Renamed:
    name = "renamed_mlm"
    bert_at = None
    console_keys = ("loss", "renamed_mlm_loss")

    def __init__(self):
        self.base = objective.get("mlm")

    def build_model(self, config, bert):
        return self.base.build_model(config, bert)

    def step_config(self, config, special_ids):
        return self.base.step_config(config, special_ids)

    def teacher_model(self, model, step_cfg):
        return None

    def train_step(self, model, step_cfg, tx, schedule, teacher_model):
        from tacl_jax.train.step import make_loss_and_grads
        from tacl_jax.train.update import train_step_from
        return train_step_from(make_loss_and_grads(model, step_cfg), tx, schedule, self.ratios)

    def eval_step(self, model, step_cfg, teacher_model):
        return self.base.eval_step(model, step_cfg, None)

    def ratios(self, sums):
        return {"renamed_" + k: v for k, v in self.base.ratios(sums).items()}

    def flops(self, model, step_cfg, *, batch, length):
        return 123.0


RENAMED = _Renamed()


@pytest.mark.slow
def test_a_registry_entry_plugs_in_a_new_objective(monkeypatch):
    """setup.build_program builds, and the loop's step runs, an objective it has never heard of."""
    monkeypatch.setitem(sys.modules, "toy_objective_module", sys.modules[__name__])
    monkeypatch.setitem(objective.REGISTRY, "renamed_mlm", "toy_objective_module:RENAMED")
    c = _config("mlm")
    c.objective = "renamed_mlm"
    prog = setup.build_program(c, jax.devices()[:1])
    assert prog.objective is RENAMED and prog.teacher_model is None and prog.flops_per_step == 123.0
    state = prog.create_state()
    with jax.set_mesh(prog.mesh):
        state, metrics = prog.train_step(state, None, _batch(prog), jax.random.key(0))
    metrics = jax.device_get(metrics)
    assert int(state.step) == 1 and np.isfinite(metrics["renamed_mlm_loss"]) and "mlm_loss" not in metrics
    # The same model and step config as plain MLM: the same first-step loss.
    c2 = _config("mlm")
    prog2 = setup.build_program(c2, jax.devices()[:1])
    with jax.set_mesh(prog2.mesh):
        _, m2 = prog2.train_step(prog2.create_state(), None, _batch(prog2), jax.random.key(0))
    np.testing.assert_allclose(metrics["renamed_mlm_loss"], float(m2["mlm_loss"]), rtol=1e-6)


def test_the_package_has_no_import_cycles():
    """Imports between tacl_jax modules (module- or function-level; the objective registry's
    importlib lookups aside) form no cycle: setup -> objective -> step/coco_step -> update,
    nothing pointing back up."""
    import ast

    root = ROOT / "tacl_jax"
    mods = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):   # function-level imports too
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tacl_jax"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("tacl_jax")}
        graph[name] = {d for d in deps if d in mods and d != name}
    assert graph["tacl_jax.train.setup"] >= {"tacl_jax.train.objective"}   # the walk sees real edges
    state, cycles = {}, []

    def visit(u, path):
        state[u] = "open"
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                cycles.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
