"""Two JAX processes on 127.0.0.1 (``jax.distributed``, 2 CPU devices each) run the real loop on
real text and agree with one process on 4 devices: the same losses, checkpoints saved and resumed
by both processes, metrics and the HF export written once."""

import json
import os
import pathlib
import socket
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # two or three training processes per test

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _corpus(tmp_path) -> pathlib.Path:
    """Real English: CPython's reference-manual topics, one blank-line-separated document each."""
    from pydoc_data import topics

    docs = [t.strip() for _, t in sorted(topics.topics.items())][:120]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(docs))
    return path


def _args(workdir, corpus, tokenizer, steps_per_run=0, num_train_steps=5, every=2):
    return [sys.executable, "-m", "tacl_jax.main", f"--config={ROOT / 'configs' / 'tiny.py'}",
            f"--workdir={workdir}", f"--config.num_train_steps={num_train_steps}",
            f"--config.steps_per_run={steps_per_run}", "--config.log_every=1",
            f"--config.data.source=text:{corpus}", f"--config.init.tokenizer_path={tokenizer}",
            "--config.init.scratch.vocab_size=30522", f"--config.checkpoint.every={every}",
            "--config.eval_at_end=False", "--config.max_len=32", "--config.global_batch_size=8"]


def _env(devices: int):
    env = dict(os.environ)
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               JAX_DISABLE_MOST_OPTIMIZATIONS="true", PYTHONPATH=str(ROOT))
    return env


def _start_two(workdir, corpus, tokenizer, **kw):
    port = _free_port()
    return [subprocess.Popen(
        _args(workdir, corpus, tokenizer, **kw) + [
            f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
        env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]


def _run_two(workdir, corpus, tokenizer, **kw):
    procs = _start_two(workdir, corpus, tokenizer, **kw)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def _losses(workdir):
    rows = [json.loads(x) for x in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_two_processes_equal_one_process_four_devices(tmp_path, minilm_dir):
    corpus = _corpus(tmp_path)
    two, one = tmp_path / "two", tmp_path / "one"

    outs = _run_two(two, corpus, minilm_dir, steps_per_run=3)      # stops at step 3 with a checkpoint
    assert "process 0 of 2" in outs[0] and "[p1]" in outs[1]          # per-process log prefixes
    first = _losses(two)
    assert [r["step"] for r in first] == [1, 2, 3]                    # written once, by process 0
    outs = _run_two(two, corpus, minilm_dir)                          # both processes resume
    assert all("resuming from" in o and "/checkpoints/3" in o for o in outs)
    assert sorted(os.listdir(two / "checkpoints")) == ["4", "5"] or "5" in os.listdir(two / "checkpoints")
    assert (two / "export" / "final" / "model.safetensors").is_file()  # HF export from one process

    p = subprocess.run(_args(one, corpus, minilm_dir), env=_env(4), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ref = {r["step"]: r for r in _losses(one)}
    got = {r["step"]: r for r in _losses(two)}
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    for s in ref:
        for k in ("loss", "mlm_loss", "tacl_loss", "grad_norm"):
            np.testing.assert_allclose(got[s][k], ref[s][k], rtol=1e-5, err_msg=f"step {s} {k}")


def test_sigterm_to_one_of_two_processes_saves_one_step_on_both_and_the_rerun_resumes(tmp_path, minilm_dir):
    """SIGTERM reaches one process (a maintenance event, ``tpu_vm.sh stop`` on one worker): JAX's
    preemption notifier and Orbax's ``reached_preemption`` make both save the same step and exit 0."""
    corpus, run = _corpus(tmp_path), tmp_path / "run"
    procs = _start_two(run, corpus, minilm_dir, num_train_steps=400, every=1000)
    metrics, t0 = run / "metrics.jsonl", time.time()
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert all(p.poll() is None for p in procs) and time.time() - t0 < 400, "the run ended early"
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        assert "preempted: checkpoint of step" in out, out[-3000:]
    saved = sorted(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit())
    assert len(saved) == 1 and 2 <= saved[0] < 400, saved
    assert all(f"checkpoint of step {saved[0]} " in out for out in outs)
    outs = _run_two(run, corpus, minilm_dir, num_train_steps=saved[0] + 1, every=1000)
    assert all(f"resuming from {run}/checkpoints/{saved[0]}" in o for o in outs), outs[0][-3000:]
    assert [r["step"] for r in _losses(run)][-1] == saved[0] + 1
