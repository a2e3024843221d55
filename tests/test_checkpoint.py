"""Checkpoints: exact resume after SIGKILL, SIGTERM save-and-exit, interrupted saves, foreign
directories, restore onto a different mesh, and the HF export CLI."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tacl_jax import checkpoint
from tacl_jax.train import loop

from test_train import tiny_config

pytestmark = pytest.mark.slow  # kill/resume, CLI and full training runs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rows(workdir):
    """Last logged value per step (a resumed run re-logs the steps after its checkpoint)."""
    out = {}
    for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r
    return out


def _cli(workdir, *overrides):
    return [sys.executable, "-m", "tacl_jax.main", f"--config={ROOT / 'configs' / 'tiny.py'}",
            f"--workdir={workdir}", *[f"--config.{o}" for o in overrides]]


def _env():
    env = dict(os.environ)
    # Same devices and XLA options as this process, so the runs compile the same program.
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               JAX_DISABLE_MOST_OPTIMIZATIONS="true", PYTHONPATH=str(ROOT))
    return env


def _wait_for_step(workdir, step, proc, timeout=240):
    path = pathlib.Path(workdir) / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stdout.read() if proc.stdout else ''}")
        if path.exists() and any(json.loads(x).get("step", 0) >= step for x in path.read_text().splitlines() if x):
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


N = 12
RUN = ("num_train_steps=12", "log_every=1", "checkpoint.every=1", "export_at_end=False", "eval_at_end=False")


def test_sigkill_then_sigterm_then_resume_equals_uninterrupted_run(tmp_path):
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "run"
    config = tiny_config(num_train_steps=N, log_every=1, export_at_end=False, eval_at_end=False)
    config.checkpoint.every = 1
    ref = loop.train_and_evaluate(config, str(ref_dir))

    # 1) SIGKILL in the middle of the run (saves are async and every step: likely mid-save).
    p = subprocess.Popen(_cli(dir_, *RUN), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_step(dir_, 3, p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = max(_rows(dir_))
    assert killed_at < N

    # 2) Resume, then SIGTERM: the run saves at the next step boundary and exits cleanly.
    p = subprocess.Popen(_cli(dir_, *RUN), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_step(dir_, killed_at + 2, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert "resuming from" in out and "preempted" in out
    mgr = checkpoint.CheckpointManager(str(dir_), config.checkpoint)
    term_step = mgr.latest_step()
    mgr.close()
    assert killed_at < term_step < N

    # 3) Resume to the end in this process: every step's loss and the final params are bitwise equal.
    res = loop.train_and_evaluate(config, str(dir_))
    assert res["status"] == "finished"
    a, b = _rows(ref_dir), _rows(dir_)
    assert sorted(a) == sorted(b) == list(range(1, N + 1))
    for s in a:
        for k in ("loss", "mlm_loss", "tacl_loss", "grad_norm"):
            assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])
    for x, y in zip(jax.tree.leaves(jax.device_get(ref["state"].params)), jax.tree.leaves(jax.device_get(res["state"].params))):
        np.testing.assert_array_equal(x, y)

    # 4) Rerunning a finished run does nothing and says so.
    again = loop.train_and_evaluate(config, str(dir_))
    assert again["status"] == "already_finished"


def test_interrupted_save_is_ignored_and_foreign_dirs_are_refused(tmp_path, caplog):
    config = tiny_config(num_train_steps=4, export_at_end=False, eval_at_end=False)
    config.checkpoint.every = 2
    loop.train_and_evaluate(config, str(tmp_path))
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == ["2", "4"]
    # What a kill during an async save leaves behind: a step under a temporary name.
    shutil.copytree(ck / "4", ck / "6.orbax-checkpoint-tmp-1234")
    (ck / "6.orbax-checkpoint-tmp-1234" / "state").rename(ck / "6.orbax-checkpoint-tmp-1234" / "state_partial")
    config.num_train_steps = 6
    import logging
    with caplog.at_level(logging.WARNING):
        res = loop.train_and_evaluate(config, str(tmp_path))
    assert "did not complete" in caplog.text
    assert res["status"] == "finished" and int(res["state"].step) == 6
    assert (ck / "6.orbax-checkpoint-tmp-1234").exists() or (ck / "6").exists()

    # A foreign directory in place of a step: a clear error, and nothing is deleted.
    other = tmp_path / "other"
    (other / "checkpoints" / "10").mkdir(parents=True)
    (other / "checkpoints" / "10" / "weights.bin").write_bytes(b"not ours")
    with pytest.raises(checkpoint.CheckpointError, match="not a tacl_jax checkpoint"):
        loop.train_and_evaluate(config, str(other))
    assert (other / "checkpoints" / "10" / "weights.bin").read_bytes() == b"not ours"


def test_restore_onto_a_different_mesh(tmp_path):
    config = tiny_config(num_train_steps=3, export_at_end=False, eval_at_end=False)
    config.mesh.update(data=1, fsdp=8, tensor=1)
    saved = loop.train_and_evaluate(config, str(tmp_path))
    config4 = tiny_config(num_train_steps=3, export_at_end=False, eval_at_end=False, mesh_devices=4)
    config4.mesh.update(data=2, fsdp=1, tensor=2)
    restored = loop.train_and_evaluate(config4, str(tmp_path))
    assert restored["status"] == "already_finished"
    leaf = jax.tree.leaves(restored["state"].params)[0]
    assert len(leaf.sharding.device_set) == 4
    for x, y in zip(jax.tree.leaves(jax.device_get(saved["state"].params)),
                    jax.tree.leaves(jax.device_get(restored["state"].params))):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(jax.device_get(saved["state"].opt_state)),
                    jax.tree.leaves(jax.device_get(restored["state"].opt_state))):
        np.testing.assert_array_equal(x, y)


def test_convert_cli_exports_a_checkpoint_transformers_loads(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from tacl_jax.convert import export_checkpoint

    config = tiny_config(num_train_steps=2, export_at_end=False, eval_at_end=False)
    config.model.dtype = "float32"
    res = loop.train_and_evaluate(config, str(tmp_path / "run"))
    out = subprocess.run([sys.executable, "-m", "tacl_jax.convert", "to_hf", f"--workdir={tmp_path / 'run'}",
                          f"--out={tmp_path / 'hf'}"], env=_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "tacl_jax_export.json"]
    pt, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = np.array([[2, 10, 11, 12, 3, 0]])
    mask = (ids != 0).astype(np.int64)
    ours = res["model"].apply({"params": res["state"].params}, ids, mask, deterministic=True).mlm_logits
    with torch.no_grad():
        theirs = pt.eval()(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours)[0, :5], theirs[0, :5], atol=1e-4, rtol=1e-4)
    # --head=none: TaCL's release format, loads as BertModel.
    export_checkpoint(str(tmp_path / "run"), str(tmp_path / "enc"), head="none")
    enc, info = transformers.AutoModel.from_pretrained(tmp_path / "enc", output_loading_info=True)
    assert type(enc).__name__ == "BertModel" and not info["missing_keys"] and not info["unexpected_keys"]
    with pytest.raises(ValueError, match="no checkpoint of step 7"):
        export_checkpoint(str(tmp_path / "run"), str(tmp_path / "x"), step=7)
