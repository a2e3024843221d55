"""Nothing lost, nothing silent: a diverging run, a lost final export, two runs on one workdir, a
changed config on resume, a damaged or unwritable checkpoint, signals, and metrics.jsonl."""

import asyncio
import gc
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tacl_jax import checkpoint, signals
from tacl_jax import workdir as workdir_lib
from tacl_jax.train import loop
from tacl_jax.train import metrics

from test_checkpoint import _cli, _env
from test_train import tiny_config


def _quick(**overrides):
    """A tiny run without its end-of-run extras unless a test asks for them."""
    base = dict(export_at_end=False, eval_at_end=False, log_every=1)
    base.update(overrides)
    config = tiny_config(**base)
    config.analysis.enabled = False
    return config


def _metric_rows(workdir) -> list[dict]:
    def refuse(name):
        raise AssertionError(f"metrics.jsonl holds a bare {name}: not JSON")

    text = (pathlib.Path(workdir) / "metrics.jsonl").read_text()
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def _checkpointed_params(workdir, config, step):
    mgr = checkpoint.CheckpointManager(str(workdir), config.checkpoint)
    try:
        from tacl_jax.train.setup import build_program, run_devices
        prog = build_program(config, run_devices(config))
        state, _, _ = mgr.restore(step, prog.abstract_state)
    finally:
        mgr.close()
    return jax.device_get(state.params)


# ----------------------------------------------------------------------------- divergence

def _all_checkpoints_finite(workdir, config) -> list[int]:
    mgr = checkpoint.CheckpointManager(str(workdir), config.checkpoint)
    steps = mgr.all_steps()
    mgr.close()
    for s in steps:
        for leaf in jax.tree.leaves(_checkpointed_params(workdir, config, s)):
            assert np.isfinite(leaf).all(), f"checkpoint {s} holds non-finite params"
    return steps


@pytest.mark.slow
def test_a_diverging_run_never_saves_non_finite_state_and_resumes_from_the_last_finite(tmp_path, caplog):
    config = _quick(num_train_steps=8)
    config.optim.learning_rate = 1e9   # finite loss at the first steps, NaN params soon after
    config.optim.warmup_fraction = 0.5
    config.checkpoint.update(every=1, keep=2)
    with pytest.raises(loop.NonFiniteLossError, match="diverged") as err:
        loop.train_and_evaluate(config, str(tmp_path))
    # Rotation (keep=2) never deleted the last finite checkpoint: every one left is finite.
    steps = _all_checkpoints_finite(tmp_path, config)
    assert steps and f"last finite checkpoint is {tmp_path}/checkpoints/{max(steps)}" in str(err.value)
    _metric_rows(tmp_path)   # valid JSON, though NaN values were logged
    # A rerun resumes from that checkpoint. (Finite is not sane: params blown up to 1e10 by this
    # learning rate may diverge again; then again nothing non-finite is saved.)
    config.optim.learning_rate = 1e-3
    with caplog.at_level("INFO", logger="tacl_jax.train"):
        try:
            loop.train_and_evaluate(config, str(tmp_path))
        except loop.NonFiniteLossError:
            pass
    assert f"resuming from {tmp_path}/checkpoints/{max(steps)}" in caplog.text
    _all_checkpoints_finite(tmp_path, config)


# ----------------------------------------------------------------------------- end of run

@pytest.mark.slow
def test_a_finished_run_redoes_a_lost_final_export(tmp_path, caplog):
    config = _quick(num_train_steps=2, export_at_end=True, eval_at_end=True)
    (tmp_path / "export").write_text("in the way")   # the export fails after the last checkpoint
    with pytest.raises(Exception, match="export"):
        loop.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "export").is_dir()
    os.remove(tmp_path / "export")
    with caplog.at_level("INFO", logger="tacl_jax.train"):
        out = loop.train_and_evaluate(config, str(tmp_path))
    assert "redoing export" in caplog.text
    assert out["status"] == "already_finished"
    assert (tmp_path / "export" / "final" / "model.safetensors").is_file()
    # The final evaluation was logged once (by the first run); the rerun did not repeat it.
    evals = [r for r in _metric_rows(tmp_path) if "eval_mlm_loss" in r]
    assert [r["step"] for r in evals] == [2]
    # With everything there, a rerun does nothing.
    caplog.clear()
    with caplog.at_level("INFO", logger="tacl_jax.train"):
        again = loop.train_and_evaluate(config, str(tmp_path))
    assert again["status"] == "already_finished" and "nothing to do" in caplog.text


def _export_tensors(folder) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_a_resume_redoes_the_step_export_lost_after_its_checkpoint(tmp_path, caplog):
    """A stop between step N's checkpoint and its hf_export_every export: the resume (mid-run, and
    of a finished run) writes that export again from the restored state, equal to the lost one."""
    config = _quick(num_train_steps=4, hf_export_every=2, steps_per_run=2)
    config.checkpoint.every = 2
    assert loop.train_and_evaluate(config, str(tmp_path))["status"] == "paused"
    exports = tmp_path / "export"
    lost = {2: _export_tensors(exports / "step_2")}
    shutil.rmtree(exports / "step_2")
    config.steps_per_run = 0
    with caplog.at_level("INFO", logger="tacl_jax.train"):
        assert loop.train_and_evaluate(config, str(tmp_path))["status"] == "finished"
    assert "redoing the export of step 2" in caplog.text
    lost[4] = _export_tensors(exports / "step_4")
    shutil.rmtree(exports / "step_4")
    caplog.clear()
    with caplog.at_level("INFO", logger="tacl_jax.train"):
        assert loop.train_and_evaluate(config, str(tmp_path))["status"] == "already_finished"
    assert "redoing step_export" in caplog.text and "redoing the export of step 4" in caplog.text
    for step, before in lost.items():
        again = _export_tensors(exports / f"step_{step}")
        assert again.keys() == before.keys()
        for k in before:
            np.testing.assert_array_equal(again[k], before[k], err_msg=f"step_{step}/{k}")
    # Step 2 and step 4 differ: each redone export is its own step's state, not the latest.
    assert any(not np.array_equal(lost[2][k], lost[4][k]) for k in lost[2])
    caplog.clear()
    with caplog.at_level("INFO", logger="tacl_jax.train"):
        assert loop.train_and_evaluate(config, str(tmp_path))["status"] == "already_finished"
    assert "nothing to do" in caplog.text


# ----------------------------------------------------------------------------- the workdir

@pytest.mark.slow
def test_a_workdir_held_by_a_live_run_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, caplog):
    config = _quick(num_train_steps=1)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / workdir_lib.LOCK_NAME).write_text(json.dumps(
            dict(host=socket.gethostname(), pid=holder.pid, started="2026-12-04T10:00:00+00:00")))
        with pytest.raises(workdir_lib.WorkdirError, match=f"pid {holder.pid}"):
            loop.train_and_evaluate(config, str(tmp_path))
        assert not (tmp_path / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone: its lock is stale and taken over, and released when the run ends.
    with caplog.at_level("WARNING", logger="tacl_jax.workdir"):
        out = loop.train_and_evaluate(config, str(tmp_path))
    assert out["status"] == "finished" and "taking over the workdir lock" in caplog.text
    assert not (tmp_path / workdir_lib.LOCK_NAME).exists()


def test_lock_of_another_host_is_stale_only_without_a_heartbeat(tmp_path, monkeypatch):
    lock_file = tmp_path / workdir_lib.LOCK_NAME
    lock_file.write_text(json.dumps(dict(host="other-host", pid=1, started="x")))
    with pytest.raises(workdir_lib.WorkdirError, match="host other-host"):
        workdir_lib.WorkdirLock(str(tmp_path)).acquire()
    old = time.time() - workdir_lib.STALE_S - 5
    os.utime(lock_file, (old, old))
    lock = workdir_lib.WorkdirLock(str(tmp_path)).acquire()
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    # The heartbeat keeps a live lock fresh.
    monkeypatch.setattr(workdir_lib, "HEARTBEAT_S", 0.05)
    lock.release()
    lock = workdir_lib.WorkdirLock(str(tmp_path)).acquire()
    os.utime(lock_file, (old, old))
    time.sleep(0.3)
    assert time.time() - os.path.getmtime(lock_file) < 5
    lock.release()
    assert not lock_file.exists()


def test_a_workdir_that_is_a_file_or_unwritable_is_refused_before_compiling(tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(loop, "build_program", lambda *a, **k: called.append(1))
    path = tmp_path / "afile"
    path.write_text("x")
    with pytest.raises(workdir_lib.WorkdirError, match="is a file"):
        loop.train_and_evaluate(_quick(), str(path))
    # Unwritable: the probe write fails (this suite may run as root, where chmod cannot show it).
    real_open = open

    def refusing_open(name, mode="r", *a, **k):
        if ".write-test-" in str(name):
            raise PermissionError(13, "Permission denied", str(name))
        return real_open(name, mode, *a, **k)

    monkeypatch.setattr("builtins.open", refusing_open)
    with pytest.raises(workdir_lib.WorkdirError, match="not writable"):
        loop.train_and_evaluate(_quick(), str(tmp_path / "ro"))
    assert not called


# ----------------------------------------------------------------------------- resume

@pytest.mark.slow
def test_resume_refuses_a_changed_objective_and_warns_about_a_changed_learning_rate(tmp_path, caplog):
    config = _quick(num_train_steps=4, steps_per_run=2)
    config.checkpoint.every = 2
    assert loop.train_and_evaluate(config, str(tmp_path))["status"] == "paused"
    changed = _quick(num_train_steps=4, objective="mlm")
    with pytest.raises(Exception, match="objective") as err:
        loop.train_and_evaluate(changed, str(tmp_path))
    assert "tacl" in str(err.value) and "mlm" in str(err.value)
    config.optim.learning_rate = 5e-4
    with caplog.at_level("WARNING", logger="tacl_jax.train"):
        out = loop.train_and_evaluate(config, str(tmp_path))
    assert out["status"] == "finished"
    assert "optim.learning_rate" in caplog.text and "0.0005" in caplog.text


def _truncate_array_files(step_dir: pathlib.Path) -> None:
    """A copy cut short: every array data file of a checkpoint step truncated to half."""
    arrays = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.stat().st_size > 64
              and "metadata" not in p.name.lower()]
    assert arrays
    for p in arrays:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before_and_resumes_exactly(tmp_path, caplog):
    ref_dir, run = tmp_path / "ref", tmp_path / "run"
    config = _quick(num_train_steps=4)
    config.checkpoint.every = 1
    ref = loop.train_and_evaluate(config, str(ref_dir))
    first = _quick(num_train_steps=4, steps_per_run=3)
    first.checkpoint.every = 1
    loop.train_and_evaluate(first, str(run))
    _truncate_array_files(run / "checkpoints" / "3")
    with caplog.at_level("WARNING", logger="tacl_jax.checkpoint"):
        res = loop.train_and_evaluate(config, str(run))
    assert "IS DAMAGED" in caplog.text and "resumes from step 2" in caplog.text
    assert len(list((run / "checkpoints_damaged").iterdir())) == 1
    # The redone steps equal the uninterrupted run's, and each step is logged once.
    rows, ref_rows = _metric_rows(run), _metric_rows(ref_dir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows if "loss" in r] == [r["loss"] for r in ref_rows if "loss" in r]
    for x, y in zip(jax.tree.leaves(jax.device_get(ref["state"].params)),
                    jax.tree.leaves(jax.device_get(res["state"].params))):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def recorded_unraisables(monkeypatch):
    """``sys.unraisablehook`` replaced by a recorder (what pytest's own hook would have turned into
    a warning); the wrapper a restore installs wraps it, and both go at the test's end."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


@pytest.fixture
def recorded_asyncio_errors(monkeypatch):
    """The ``asyncio`` logger's records that pass its filters (those a user would see), with the
    logger's filters put back at the test's end."""
    logger, seen = logging.getLogger("asyncio"), []
    monkeypatch.setattr(logger, "filters", list(logger.filters))
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def _raise(e: BaseException):
    raise e


class _RaisesOnDel:
    def __init__(self, fn):
        self.fn = fn

    def __del__(self):
        self.fn()


def test_late_reads_of_a_failed_restore_are_dropped_and_other_unraisables_pass(recorded_unraisables):
    closed = asyncio.new_event_loop()
    closed.close()
    checkpoint._drop_late_read_completions()
    checkpoint._drop_late_read_completions()      # once: a second restore does not wrap again
    assert sys.unraisablehook._tacl_jax_drops_late_reads
    _RaisesOnDel(lambda: closed.call_soon_threadsafe(print))     # what a TensorStore thread raises
    _RaisesOnDel(lambda: _raise(RuntimeError("Event loop is closed")))      # the same words, not from asyncio
    _RaisesOnDel(lambda: _raise(ValueError("a bug of ours")))
    assert [(type(u.exc_value), str(u.exc_value)) for u in recorded_unraisables] == [
        (RuntimeError, "Event loop is closed"), (ValueError, "a bug of ours")]


def test_unretrieved_read_errors_of_a_failed_restore_are_dropped_and_other_asyncio_errors_pass(
        recorded_asyncio_errors):
    checkpoint._drop_unretrieved_read_errors()
    checkpoint._drop_unretrieved_read_errors()    # once: a second restore adds no second filter
    assert logging.getLogger("asyncio").filters.count(checkpoint._keeps_asyncio_record) == 1
    read_error = ValueError('DATA_LOSS: Error opening "zarr" driver [tensorstore_spec=\'{"driver":"zarr"}\']')
    never, destroyed = "exception was never retrieved", "Task was destroyed but it is pending!"
    loop = asyncio.new_event_loop()
    try:   # asyncio's default handler logs these, as it does for a garbage-collected task or future
        loop.call_exception_handler({"message": f"Task {never}", "exception": read_error})
        loop.call_exception_handler({"message": f"Future {never}", "exception": read_error})
        loop.call_exception_handler({"message": f"Task {never}", "exception": ValueError("a bug of ours")})
        loop.call_exception_handler({"message": destroyed, "exception": read_error})
    finally:
        loop.close()
    assert [(r.msg.splitlines()[0], str(r.exc_info[1])) for r in recorded_asyncio_errors] == [
        (f"Task {never}", "a bug of ours"), (destroyed, str(read_error))]


def test_restoring_a_damaged_checkpoint_prints_no_late_read_tracebacks(tmp_path, recorded_unraisables,
                                                                       recorded_asyncio_errors):
    # Orbax closes the restore's event loop at the first failed read; the reads still in flight then
    # raise in TensorStore threads (two or so per restore of 40 arrays here, before the filter), and
    # the reads that failed unawaited are logged by asyncio when collected (in 3 of 8 runs here).
    config = _quick()
    mgr = checkpoint.CheckpointManager(str(tmp_path), config.checkpoint)
    tree = {f"a{i}": np.random.default_rng(i).random((256, 256), np.float32) for i in range(40)}
    try:
        mgr.save(1, tree, {"step": 1}, config, force=True)
        mgr.wait()
        _truncate_array_files(tmp_path / "checkpoints" / "1")
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        for _ in range(5):
            with pytest.raises(checkpoint.CheckpointError, match="cannot be restored"):
                mgr.restore(1, abstract)
        time.sleep(1.0)   # the late completions arrive from TensorStore's threads
    finally:
        mgr.close()
    gc.collect()      # the failed reads' tasks, never awaited, log when collected
    assert [str(u.exc_value) for u in recorded_unraisables] == []
    assert [r.getMessage()[:80] for r in recorded_asyncio_errors] == []


@pytest.mark.slow
def test_a_failed_save_says_so_in_one_line_with_the_last_good_checkpoint(tmp_path, monkeypatch):
    config = _quick(num_train_steps=4)
    config.checkpoint.update(every=1, async_save=False)
    real_save = checkpoint.ocp.CheckpointManager.save
    calls = []

    def full_disk(self, step, *a, **k):
        calls.append(step)
        if step >= 3:
            raise OSError(28, "No space left on device")
        return real_save(self, step, *a, **k)

    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError) as err:
        loop.train_and_evaluate(config, str(tmp_path))
    msg = str(err.value)
    assert "step 3" in msg and "No space left on device" in msg and msg.count("\n") == 0
    assert f"{tmp_path}/checkpoints/2" in msg


# ----------------------------------------------------------------------------- signals

def test_ctrl_c_sets_the_stop_flag_and_a_second_one_interrupts():
    before = signal.getsignal(signal.SIGTERM)
    flag = signals.StopFlag().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.is_set() and flag.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        flag.reset()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.is_set() and flag.signal_name == "SIGTERM"
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    # With several processes SIGTERM belongs to JAX's notifier: the flag never stops one alone.
    multi = signals.StopFlag().install(multi_process=True)
    assert signal.getsignal(signal.SIGTERM) is before
    multi.event.set()
    assert not multi.is_set()


@pytest.mark.slow
def test_sigterm_during_start_up_is_said_and_exits_0(tmp_path):
    env = _env()
    # Without JAX_PLATFORMS, as a user runs it: main sees no chip and says "cpu" to jax itself, so an
    # installed libtpu (the aot extra) does not log a failed TPU probe at every start.
    env.pop("JAX_PLATFORMS")
    p = subprocess.Popen(_cli(tmp_path, "num_train_steps=3", "export_at_end=False", "eval_at_end=False"),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:   # the first log line is written before the model is built
        lines.append(line)
        if "allocator:" in line:
            p.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + p.communicate(timeout=300)[0]
    assert p.returncode == 0, out[-3000:]
    assert "SIGTERM during start-up" in out
    assert "Unable to initialize backend" not in out and "libtpu" not in out
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


# ----------------------------------------------------------------------------- metrics.jsonl

def test_metric_rows_are_json_and_rows_past_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    w = metrics.MetricWriter(str(tmp_path), resumed_at=2)
    w.write(3, {"loss": float("nan"), "grad_norm": float("inf")}, total_steps=4)
    w.close()
    rows = _metric_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["loss"] == "NaN" and rows[-1]["grad_norm"] == "Infinity"
    assert np.isnan(float(rows[-1]["loss"]))


@pytest.mark.slow
def test_a_run_resumed_from_params_from_keeps_its_teacher(tmp_path):
    """A TaCL run started from another run's params (``init.params_from``, no ``hf_path``) records
    the step it used; resumed, it rebuilds the teacher from that step — even after the other run
    moved on — and ends equal to the uninterrupted run (before: a seed-initialised teacher)."""
    src, ref_dir, run = tmp_path / "src", tmp_path / "ref", tmp_path / "run"
    loop.train_and_evaluate(_quick(num_train_steps=2), str(src))

    def config(**kw):
        c = _quick(num_train_steps=4, **kw)
        c.init.params_from = str(src)
        c.checkpoint.every = 1
        return c

    ref = loop.train_and_evaluate(config(), str(ref_dir))
    loop.train_and_evaluate(config(steps_per_run=2), str(run))
    loop.train_and_evaluate(_quick(num_train_steps=3), str(src))      # the source's latest is now step 3
    res = loop.train_and_evaluate(config(), str(run))
    rows, ref_rows = _metric_rows(run), _metric_rows(ref_dir)
    assert [r["tacl_loss"] for r in rows if "tacl_loss" in r] == [r["tacl_loss"] for r in ref_rows if "tacl_loss" in r]
    for x, y in zip(jax.tree.leaves(jax.device_get(ref["state"].params)),
                    jax.tree.leaves(jax.device_get(res["state"].params))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_params_from_step_that_does_not_exist_is_named(tmp_path):
    src = tmp_path / "src"
    loop.train_and_evaluate(_quick(num_train_steps=2), str(src))
    c = _quick(num_train_steps=2)
    c.init.params_from, c.init.params_from_step = str(src), 7
    with pytest.raises(checkpoint.CheckpointError, match=r"has no checkpoint of step 7 \(it has \[2\]\)"):
        loop.train_and_evaluate(c, str(tmp_path / "run"))
