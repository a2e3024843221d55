"""bench/tacl_effect.py's multi-seed summary against numpy on made-up per-seed results."""

import importlib.util
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "tacl_effect.py")


@pytest.fixture(scope="module")
def tacl_effect():
    spec = importlib.util.spec_from_file_location("tacl_effect", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _result(rng, names=("init", "mlm_only", "tacl")):
    return {n: dict(last_layer_self_similarity=float(rng.uniform(0.2, 0.5)), heldout_mlm_acc=float(rng.uniform(0, 0.4)),
                    heldout_mlm_loss=float(rng.uniform(4, 11))) for n in names}


def test_summary_matches_numpy(tacl_effect):
    rng = np.random.default_rng(0)
    per_seed = {s: _result(rng) for s in (0, 3, 7)}
    s = tacl_effect.summarize(per_seed)
    for name in ("init", "mlm_only", "tacl"):
        for k in ("last_layer_self_similarity", "heldout_mlm_acc", "heldout_mlm_loss"):
            v = np.array([r[name][k] for r in per_seed.values()])
            assert s[name][k]["mean"] == pytest.approx(v.mean(), abs=1e-12)
            assert s[name][k]["std"] == pytest.approx(v.std(ddof=1), abs=1e-12)
            assert s[name][k]["n"] == 3
    d = np.array([r["tacl"]["last_layer_self_similarity"] - r["mlm_only"]["last_layer_self_similarity"]
                  for r in per_seed.values()])
    diff = s["tacl_minus_mlm_only"]
    assert diff["last_layer_self_similarity"]["mean"] == pytest.approx(d.mean(), abs=1e-12)
    assert diff["last_layer_self_similarity"]["std"] == pytest.approx(d.std(ddof=1), abs=1e-12)
    assert list(diff["per_seed_self_similarity"]) == [0, 3, 7]
    assert diff["per_seed_self_similarity"][3] == pytest.approx(d[1])
    acc = [r["tacl"]["heldout_mlm_acc"] - r["mlm_only"]["heldout_mlm_acc"] for r in per_seed.values()]
    assert diff["heldout_mlm_acc"]["mean"] == pytest.approx(np.mean(acc), abs=1e-12)
    assert s["tacl_lower_self_similarity"] == f"{int((d < 0).sum())} of 3 seeds"


def test_summary_counts_seeds_with_tacl_lower(tacl_effect):
    def res(mlm, tacl):
        return dict(mlm_only=dict(last_layer_self_similarity=mlm, heldout_mlm_acc=0.3, heldout_mlm_loss=5.0),
                    tacl=dict(last_layer_self_similarity=tacl, heldout_mlm_acc=0.3, heldout_mlm_loss=5.0))

    s = tacl_effect.summarize({0: res(0.24, 0.22), 1: res(0.25, 0.26), 2: res(0.30, 0.20)})
    assert s["tacl_lower_self_similarity"] == "2 of 3 seeds"
    assert "init" not in s                     # only the models every seed has
    assert s["tacl_minus_mlm_only"]["last_layer_self_similarity"]["mean"] == pytest.approx((-0.02 + 0.01 - 0.10) / 3)
