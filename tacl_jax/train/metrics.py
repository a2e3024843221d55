"""Metrics of a run: the console line, ``metrics.jsonl`` and TensorBoard (``MetricWriter``), step
time / throughput / MFU (``Timer``, ``report``), the held-out evaluation (``evaluate``), and the
divergence error."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Callable

import jax

from tacl_jax import parallel
from tacl_jax.errors import UserError
from tacl_jax.train import outputs

log = logging.getLogger(__name__)


class NonFiniteLossError(UserError, RuntimeError):
    """The run diverged; the message names the step and the last finite checkpoint."""


class MetricWriter:
    """Console line, ``metrics.jsonl`` and TensorBoard events in the workdir (its local mirror
    when the workdir is remote), from process 0 only.

    ``metrics.jsonl`` holds one row per logged step, valid JSON (a non-finite value is written as
    the string ``"NaN"``/``"Infinity"``, not a bare NaN). A run resumed at step s first drops the
    rows past s (the steps an interrupted run logged after its last checkpoint are redone), so each
    step appears once."""

    def __init__(self, workdir: str, resumed_at: int = 0,
                 console_keys: tuple[str, ...] = ("loss", "mlm_loss", "mlm_acc", "tacl_loss", "tacl_acc")):
        self.enabled = jax.process_index() == 0
        target = outputs.local_dir(workdir)
        self.path = os.path.join(target, "metrics.jsonl")
        self.tb = None
        # The objective's losses, then the optimizer's: what the console line shows when present.
        self.console_keys = tuple(console_keys) + ("grad_norm", "lr")
        if self.enabled:
            if target != workdir:
                log.info("remote workdir %s: metrics.jsonl and TensorBoard events go to %s", workdir, target)
            os.makedirs(target, exist_ok=True)
            workdir = target
            _drop_rows_after(self.path, resumed_at)
            try:
                from tensorboardX import SummaryWriter
                self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            except ImportError:  # optional: JSONL and console still work
                log.info("tensorboardX not installed: no TensorBoard events")

    def write(self, step: int, metrics: dict[str, float], total_steps: int, prefix: str = "") -> None:
        if not self.enabled:
            return
        row = {"step": step, **{prefix + k: v for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _json_number(v) for k, v in row.items()}, allow_nan=False) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        keys = [k for k in self.console_keys if k in metrics]
        shown = " ".join(f"{prefix}{k}={metrics[k]:.4g}" for k in keys)
        extra = ""
        if "tokens_per_s" in metrics:
            extra = f" tok/s={metrics['tokens_per_s']:,.0f}"
            if metrics.get("mfu"):
                extra += f" mfu={metrics['mfu']:.1%}"
            if metrics.get("eta_s") is not None:
                extra += f" eta={metrics['eta_s'] / 60:.1f}min"
        bar = _progress_bar(step, total_steps)
        log.info("%s step %d/%d %s%s", bar, step, total_steps, shown, extra)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _json_number(v):
    """JSON has no NaN/Infinity: write them as strings (``float("NaN")`` reads them back)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


def _drop_rows_after(path: str, step: int) -> None:
    """Rewrite ``path`` without the rows of steps after ``step`` (atomically: a crash leaves the
    old file or the new one). Nothing to do for a fresh run or a file without such rows."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            row_step = json.loads(line).get("step", 0)
        except ValueError:   # a line cut short by a kill: drop it too
            continue
        if row_step <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) == len(lines):
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)
    log.info("metrics.jsonl: dropped %d row(s) past the resumed step %d (those steps are redone)",
             len(lines) - len(keep), step)


def _progress_bar(step: int, total: int, width: int = 20) -> str:
    done = int(width * step / max(total, 1))
    return "[" + "#" * done + "." * (width - done) + "]"


def evaluate(p_eval, params, teacher, batches, mesh, seed: int, to_ratios: Callable) -> dict[str, float]:
    """Metrics of ``params`` on held-out ``batches`` (this process's rows): the jitted eval step's
    sums added over the batches (batch i masked with ``fold_in(key(seed), i)``, the same every
    time), then ``to_ratios`` (the objective's); ``mlm_perplexity`` = exp(mlm_loss)."""
    total: dict[str, float] = {}
    for i, local in enumerate(batches):
        sums = jax.device_get(p_eval(params, teacher, parallel.global_batch(local, mesh),
                                     jax.random.fold_in(jax.random.key(seed), i)))
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + float(v)
    out = {k: float(v) for k, v in to_ratios(total).items()}
    if "mlm_loss" in out:
        out["mlm_perplexity"] = float(math.exp(min(out["mlm_loss"], 50.0)))
    return out


class Timer:
    """Step time, compile time and ETA from host timestamps between reports."""

    def __init__(self, start_step: int):
        self.t0 = time.perf_counter()
        self.compile_s = None
        self.t_last, self.step_last = None, start_step

    def compiled(self):
        # The first dispatch returns once the step is compiled (execution is asynchronous).
        self.compile_s = time.perf_counter() - self.t0


def report(pending, writer: MetricWriter, config, timer: Timer, flops: float, peak: float | None,
            force: bool = False):
    step, metrics = pending
    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not math.isfinite(host["loss"]):
        raise NonFiniteLossError(
            f"non-finite loss {host['loss']} at step {step} ("
            + ", ".join(f"{k}={v:.4g}" for k, v in host.items() if k.endswith("_loss") or k == "grad_norm")
            + "); lower "
            "optim.learning_rate, check the data, or use model.dtype=float32")
    now = time.perf_counter()
    if not (force or step % config.log_every == 0 or step == 1):
        return host
    if timer.t_last is not None and step > timer.step_last:
        dt = (now - timer.t_last) / (step - timer.step_last)
        n_dev = jax.device_count()
        host.update(step_time_s=dt, tokens_per_s=config.global_batch_size * config.max_len / dt,
                    tokens_per_s_per_device=config.global_batch_size * config.max_len / dt / n_dev,
                    tflops_per_device=flops / dt / n_dev / 1e12,
                    eta_s=dt * (config.num_train_steps - step))
        if peak:
            host["mfu"] = flops / dt / n_dev / peak
    if timer.compile_s is not None:
        host["compile_s"] = timer.compile_s
    timer.t_last, timer.step_last = now, step
    writer.write(step, host, config.num_train_steps)
    return host
