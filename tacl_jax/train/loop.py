"""The training loop, read top to bottom: start-up → mesh → model → state → input → step → loop.

``train_and_evaluate(config, workdir)`` is what ``python -m tacl_jax.main`` runs.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tacl_jax import checkpoint, hf, parallel, signals
from tacl_jax import config as config_lib
from tacl_jax import workdir as workdir_lib
from tacl_jax import data as data_lib
from tacl_jax.errors import UserError
from tacl_jax.objectives import ratios
from tacl_jax.train.setup import (build_model, build_program, check_batch_arithmetic, check_model,  # noqa: F401
                                  create_coco_state, create_state, create_teacher, hf_params_for, initial_params,
                                  model_from_config, run_devices, state_shardings, strip_heads, teacher_of)
from tacl_jax.train.step import make_eval_step  # noqa: F401  (part of the loop's API before the split)

log = logging.getLogger(__name__)


class NonFiniteLossError(UserError, RuntimeError):
    """The run diverged; the message names the step and the last finite checkpoint."""


# ----------------------------------------------------------------------------- metrics

def local_dir(workdir: str) -> str:
    """Where files that need a POSIX filesystem (appended JSONL, TensorBoard events, the export
    staging) go: the workdir itself, or for a remote one (``gs://...``) a local mirror,
    ``$TACL_LOCAL_DIR`` or ``/tmp/tacl_jax/<bucket path>``. Checkpoints go to the workdir either way."""
    if "://" not in workdir:
        return workdir
    root = os.environ.get("TACL_LOCAL_DIR", os.path.join("/tmp", "tacl_jax"))
    return os.path.join(root, workdir.split("://", 1)[1].strip("/"))


def _copy_tree(src: str, dst: str) -> None:
    """Local folder -> remote folder (``gs://``) through etils/epath, subfolders included."""
    from etils import epath

    dst_path = epath.Path(dst)
    dst_path.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(src):
        if os.path.isdir(os.path.join(src, f)):
            _copy_tree(os.path.join(src, f), str(dst_path / f))
        else:
            (dst_path / f).write_bytes(open(os.path.join(src, f), "rb").read())


class MetricWriter:
    """Console line, ``metrics.jsonl`` and TensorBoard events in the workdir (its local mirror
    when the workdir is remote), from process 0 only.

    ``metrics.jsonl`` holds one row per logged step, valid JSON (a non-finite value is written as
    the string ``"NaN"``/``"Infinity"``, not a bare NaN). A run resumed at step s first drops the
    rows past s (the steps an interrupted run logged after its last checkpoint are redone), so each
    step appears once."""

    def __init__(self, workdir: str, resumed_at: int = 0):
        self.enabled = jax.process_index() == 0
        target = local_dir(workdir)
        self.path = os.path.join(target, "metrics.jsonl")
        self.tb = None
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
        keys = [k for k in ("loss", "mlm_loss", "mlm_acc", "tacl_loss", "tacl_acc", "nsp_loss", "mlm_perplexity",
                            "gen_mlm_loss", "binary_loss", "binary_acc", "clm_loss", "scl_loss", "scl_acc",
                            "grad_norm", "lr") if k in metrics]
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


# ----------------------------------------------------------------------------- profiling

class _Profiler:
    """``config.profile_steps='START,STOP'``: a ``jax.profiler`` trace of the steps that take the
    state from step START to step STOP, on process 0, in ``workdir/profile/`` (written to the local
    mirror and copied for a remote workdir). The trace starts before step START is dispatched and
    stops once the last profiled step's outputs are ready (so its device work is in the trace) —
    at STOP, or earlier when the run ends, pauses or is preempted inside the window (``last``);
    ``close()`` stops a trace an exception left open. A resumed run traces what is left of the window."""

    def __init__(self, config, workdir: str, start_step: int):
        window = config_lib.parse_profile_steps(config.get("profile_steps", ""))
        self.window = window if jax.process_index() == 0 else None
        self.workdir, self.local = workdir, os.path.join(local_dir(workdir), "profile")
        self.active, self.first = False, None
        if self.window is not None and start_step >= self.window[1]:
            log.info("profile_steps=%r: this run starts at step %d, after the window; no trace",
                     config.profile_steps, start_step)
            self.window = None

    def before_step(self, step: int) -> None:
        if self.window is None or self.active or step < self.window[0]:
            return
        os.makedirs(self.local, exist_ok=True)
        try:
            jax.profiler.start_trace(self.local, create_perfetto_trace=True)
        except RuntimeError:  # e.g. another trace is running in this process: train on, untraced
            log.exception("profile: could not start the trace; the run goes on without it")
            self.window = None
            return
        self.active, self.first = True, step

    def after_step(self, done: int, outputs, last: bool) -> None:
        if self.active and (done >= self.window[1] or last):
            self.stop(done, outputs)

    def close(self) -> None:
        """After an exception inside the window: stop the trace, never masking that exception."""
        if self.active:
            try:
                self.stop(None, None)
            except Exception:  # pylint: disable=broad-except
                log.exception("profile: saving the interrupted trace failed")

    def stop(self, done: int | None, outputs) -> None:
        self.active, self.window = False, None
        try:
            if outputs is not None:
                jax.block_until_ready(outputs)   # the profiled steps' device work, inside the trace
        finally:
            stopped = self._stop_trace()
        if not stopped:
            return
        target = os.path.join(self.workdir, "profile")
        if target != self.local:
            try:
                _copy_tree(self.local, target)
            except Exception:  # pylint: disable=broad-except
                log.exception("profile: copying the trace to %s failed; it is in %s", target, self.local)
                target = self.local
        perfetto = sorted(glob.glob(os.path.join(self.local, "plugins", "profile", "*", "perfetto_trace.json.gz")),
                          key=os.path.getmtime)
        perfetto_path = perfetto[-1].replace(self.local, target, 1) if perfetto else "(not written)"
        steps = (f"training steps {self.first + 1}..{done} (state step {self.first} -> {done})" if done is not None
                 else f"training from state step {self.first} until an error")
        log.info("profile: %s traced -> %s; view with `tensorboard --logdir %s` (Profile tab; pip install "
                 "tensorboard-plugin-profile) or `xprof --logdir %s`, or open %s at https://ui.perfetto.dev",
                 steps, target, target, target, perfetto_path)

    @staticmethod
    def _stop_trace() -> bool:
        try:
            jax.profiler.stop_trace()
            return True
        except Exception:  # pylint: disable=broad-except  # a failed trace must not end training
            log.exception("profile: stopping the trace failed; the run goes on")
            return False


# ----------------------------------------------------------------------------- evaluation

def evaluate(p_eval, params, teacher, batches, mesh, seed: int, to_ratios=ratios) -> dict[str, float]:
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


# ----------------------------------------------------------------------------- main loop

def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
    """Train per ``config`` in ``workdir`` (resuming from its latest checkpoint when there is one).

    Returns ``{"state", "metrics" (the last logged), "model", "status"}``; status is
    ``finished`` | ``preempted`` (SIGTERM/Ctrl-C: saved at a step boundary; or before the first
    step, with nothing new to save) | ``paused`` (``steps_per_run`` reached) | ``already_finished``
    (and every end-of-run output present; missing ones are redone first).
    """
    # --- start-up: processes, signals, config, workdir (before anything is compiled or written)
    parallel.maybe_initialize_distributed(config.distributed)
    stop = signals.install(multi_process=jax.process_count() > 1)
    config_lib.validate(config)
    workdir = os.path.abspath(workdir) if "://" not in workdir else workdir
    workdir_lib.check_writable(workdir)
    lock = _hold_workdir(workdir)
    try:
        return _train(config, workdir, stop)
    finally:
        lock.release()
        stop.reset()
        stop.uninstall()


def _hold_workdir(workdir: str) -> workdir_lib.WorkdirLock:
    """Process 0 takes the workdir lock; every process learns whether it did (a refused process 0
    must not leave the others waiting in the first collective)."""
    lock = workdir_lib.WorkdirLock(workdir, enabled=jax.process_index() == 0)
    error = None
    try:
        lock.acquire()
    except workdir_lib.WorkdirError as e:
        error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        ok = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            raise workdir_lib.WorkdirError(f"process 0 could not take the lock of {workdir} (see its log)")
    if error is not None:
        raise error
    return lock


def _train(config, workdir: str, stop: signals.StopFlag) -> dict[str, Any]:
    # --- the program: mesh, model, step config, optimizer, shardings and the jitted step, decided
    # from this run's devices (tacl_jax.train.setup; python -m tacl_jax.aot compiles the same)
    prog = build_program(config, run_devices(config))
    mesh, rules, model, step_cfg = prog.mesh, prog.rules, prog.model, prog.step_cfg
    coco, special, state_sh = prog.coco, prog.special_ids, prog.state_shardings
    log.info("mesh %s: %d process(es) × %d local device(s) (%s); global batch %d = %d per process, %d micro-batch(es)",
             dict(mesh.shape), jax.process_count(), jax.local_device_count(), prog.target.device_kind,
             config.global_batch_size, config.global_batch_size // jax.process_count(), config.grad_accum_steps)
    tok_dir = config.init.tokenizer_path or config.init.hf_path

    # --- input (before the checkpoint folder exists: a refused data config leaves nothing behind)
    data_kwargs = dict(global_batch_size=config.global_batch_size, max_len=config.max_len, seed=config.seed,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       tokenizer_dir=tok_dir or None, vocab_size=model.config.vocab_size,
                       special_ids=special, with_nsp=config.nsp)
    train_iter = data_lib.make_train_iterator(config.data, **data_kwargs)
    eval_batches = []
    if config.eval_every > 0 or config.eval_at_end:
        eval_batches = data_lib.make_eval_batches(config.data, num_batches=config.eval_batches, **data_kwargs)

    # --- state: this workdir's checkpoint → init.hf_path → init.params_from → from scratch.
    # Every start-up check above has passed: only now is workdir/checkpoints created.
    ckpt = checkpoint.CheckpointManager(workdir, config.checkpoint)
    try:
        state, data_state, hf_params = _initial_state(config, prog, ckpt, workdir)
    except BaseException:
        ckpt.close()
        train_iter.close()
        raise
    start = int(jax.device_get(state.step))
    todo = _end_outputs_missing(config, workdir) if start >= config.num_train_steps else None
    if todo is not None and not todo:
        log.info("this run already finished: step %d of %d is checkpointed in %s and its end-of-run outputs "
                 "are there; nothing to do", start, config.num_train_steps, ckpt.directory)
        ckpt.close()
        train_iter.close()
        return {"state": state, "metrics": {}, "model": model, "status": "already_finished"}
    if todo:
        log.info("this run already finished training (step %d) but its end is incomplete: redoing %s",
                 start, ", ".join(sorted(todo)))

    teacher = None
    if not coco and step_cfg.uses_teacher and (todo is None or "eval" in todo):
        init = initial_params(model, mesh, rules, config.seed, config.max_len, state_sh.params, hf_params)
        teacher, _ = create_teacher(init, state_sh.params, config.tacl.teacher_param_dtype, model.config.dtype)
        del init
    del hf_params
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    log.info("model: %d layers, hidden %d, vocab %d (padded %d), compute %s, %.2fM params; objective %s",
             model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size,
             model.config.padded_vocab_size, model.config.dtype, n_params / 1e6, config.objective)

    # --- input, at the restored step
    if data_state is not None:
        train_iter.set_state(data_state)
    if train_iter.step != start:
        raise checkpoint.CheckpointError(f"the data iterator is at step {train_iter.step} but the "
                                         f"train state at step {start}: the checkpoint is inconsistent")

    # --- step
    p_step, p_eval, eval_ratios = prog.train_step, prog.eval_step, prog.eval_ratios
    flops, peak = prog.flops_per_step, prog.peak_flops_per_device
    rng = jax.random.key(config.seed)
    export_model, export_params = prog.export_model, prog.export_params

    # --- loop; metrics are fetched one step late so the host never waits on the device.
    writer = MetricWriter(workdir, resumed_at=start)
    pending, last, status = None, {}, "finished"
    timer = _Timer(start)
    profiler = _Profiler(config, workdir, start)
    step = start
    if stop.is_set():
        status = "preempted"
        log.warning("%s during start-up: stopping before the first step; nothing new to save (the "
                    "checkpoint of step %d is the latest)", stop.signal_name, start)
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            for step in range(start, config.num_train_steps if status == "finished" else start):
                batch = prog.global_batch(next(train_iter))
                profiler.before_step(step)
                state, metrics = p_step(state, teacher, batch, rng)
                if step == start:
                    timer.compiled()
                if pending is not None:
                    last = _report(pending, writer, config, timer, flops, peak) or last
                pending = (step + 1, metrics)
                done = step + 1
                preempted = stop.is_set() or ckpt.reached_preemption(done)
                stop_here = config.steps_per_run > 0 and done - start >= config.steps_per_run
                profiler.after_step(done, (state, metrics),
                                    last=preempted or stop_here or done == config.num_train_steps)
                if preempted or stop_here or ckpt.should_save(done) or done == config.num_train_steps:
                    _check_finite_before_save(done, state, metrics, ckpt)
                    ckpt.save(done, state, train_iter.get_state(), config, force=True)
                if config.hf_export_every > 0 and done % config.hf_export_every == 0:
                    _export(export_model, export_params(state.params), workdir, f"step_{done}", tok_dir)
                if config.eval_every > 0 and done % config.eval_every == 0 and eval_batches:
                    writer.write(done, evaluate(p_eval, state.params, teacher, eval_batches, mesh, config.seed + 1, eval_ratios),
                                 config.num_train_steps, prefix="eval_")
                if preempted:
                    status = "preempted"
                    log.warning("preempted: checkpoint of step %d is being written; exiting cleanly", done)
                    break
                if stop_here and done < config.num_train_steps:
                    status = "paused"
                    log.info("steps_per_run=%d reached at step %d: checkpointed; rerun to continue",
                             config.steps_per_run, done)
                    break
            if pending is not None:
                last = _report(pending, writer, config, timer, flops, peak, force=True) or last
            evaluated_last = config.eval_every > 0 and step + 1 == config.num_train_steps and \
                config.num_train_steps % config.eval_every == 0
            if status == "finished" and config.eval_at_end and eval_batches and not evaluated_last and \
                    (todo is None or "eval" in todo):
                writer.write(config.num_train_steps, evaluate(p_eval, state.params, teacher, eval_batches, mesh,
                                                              config.seed + 1, eval_ratios), config.num_train_steps, prefix="eval_")
            if status == "finished" and config.export_at_end and (todo is None or "export" in todo):
                _export(export_model, export_params(state.params), workdir, "final", tok_dir)
    finally:
        profiler.close()
        try:
            ckpt.wait()
        finally:
            ckpt.close()
            writer.close()
            train_iter.close()
    if status == "finished" and config.analysis.enabled and jax.process_index() == 0 and \
            (todo is None or "analysis" in todo):
        try:
            analyze_at_end(config, workdir, export_model.config.max_position_embeddings)
        except Exception:  # pylint: disable=broad-except  # the run is complete and saved either way
            log.exception("analysis failed (training, checkpoint and export are complete); rerun it with "
                          "python -m tacl_jax.analyze --workdir=%s --split=heldout --out=...", workdir)
    if todo:
        status = "already_finished"
    return {"state": state, "metrics": last, "model": model, "status": status}


def _initial_state(config, prog, ckpt: checkpoint.CheckpointManager, workdir: str):
    """``(state, data_state | None, hf_params | None)``: this workdir's latest good checkpoint (a
    changed config refused or warned about first), else ``init.hf_path``, ``init.params_from`` or
    from scratch. ``hf_params`` is what the teacher starts from."""
    model, tx, mesh, rules, abstract_state = prog.model, prog.tx, prog.mesh, prog.rules, prog.abstract_state
    latest = ckpt.latest_step()
    if latest is not None:
        _check_config_unchanged(ckpt, latest, config, workdir)
        step, state, data_state, saved = ckpt.restore_latest(abstract_state)
        log.info("start-up: resuming from %s/%d", ckpt.directory, step)
        # The teacher of a resumed TaCL run is re-read from where it came from (checkpoint docstring):
        # init.hf_path, or the saved run's init.params_from at the step the fresh start recorded.
        saved_init = (saved or {}).get("init", {})
        if (not config.init.hf_path and saved_init.get("params_from") and not prog.coco
                and prog.step_cfg.uses_teacher):
            _, teacher_params = _params_from(saved_init["params_from"], saved_init.get("params_from_step", -1),
                                             config, abstract_state)
            return state, data_state, teacher_params
        return state, data_state, hf_params_for(config, model)
    hf_params = hf_params_for(config, model)
    if config.init.hf_path:
        log.info("start-up: no checkpoint in %s; student and teacher from the Hugging Face checkpoint %s",
                 ckpt.directory, config.init.hf_path)
        create = create_coco_state if prog.coco else create_state
        state, _ = create(model, tx, mesh, rules, config.seed, config.max_len, hf_params)
        return state, None, hf_params
    if config.init.params_from:
        step, params = _params_from(config.init.params_from, config.init.params_from_step, config, abstract_state)
        log.info("start-up: no checkpoint in %s; params from %s step %d (optimizer state and step reset)",
                 ckpt.directory, config.init.params_from, step)
        with config.unlocked():
            config.init.params_from_step = step      # saved with every checkpoint: the teacher on resume
        state, _ = create_state(model, tx, mesh, rules, config.seed, config.max_len, params)
        return state, None, params
    log.info("start-up: no checkpoint in %s and no init.hf_path: from scratch (seed %d)",
             ckpt.directory, config.seed)
    state, _ = create_state(model, tx, mesh, rules, config.seed, config.max_len)
    return state, None, None


def _params_from(workdir: str, step: int, config, abstract_state) -> tuple[int, Any]:
    """``(step, params as numpy)`` of another run's checkpoint: ``step``, or its latest when -1."""
    other = checkpoint.CheckpointManager(workdir, config.checkpoint)
    try:
        if step < 0:
            found = other.restore_latest(abstract_state)
        elif step in other.all_steps():
            found = (step,) + tuple(other.restore(step, abstract_state))
        else:
            raise checkpoint.CheckpointError(
                f"init.params_from={workdir!r} has no checkpoint of step {step} (it has "
                f"{sorted(other.all_steps()) or 'none'}); set --config.init.params_from_step to one of them")
    finally:
        other.close()
    if found is None:
        raise FileNotFoundError(f"init.params_from={workdir!r} has no complete checkpoint")
    return found[0], jax.device_get(found[1].params)


def _check_config_unchanged(ckpt: checkpoint.CheckpointManager, step: int, config, workdir: str) -> None:
    """A rerun must continue the run it resumes: changes to the objective, model or losses are
    refused, optimizer/schedule changes are logged key by key (``config.resume_changes``)."""
    try:
        saved = ckpt.restore_config(step)
    except Exception:  # pylint: disable=broad-except  # a damaged step: restore_latest says so next
        return
    refused, warned = config_lib.resume_changes(saved, config)
    for line in warned:
        log.warning("resuming with a changed setting: %s", line)
    if refused:
        raise config_lib.ConfigChangedError(refused, workdir)


@jax.jit
def _finite(params, metrics) -> jax.Array:
    """One bool on device: the state about to be saved and the step that made it are finite."""
    norm = optax.tree.norm(params)
    return jnp.isfinite(norm) & jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])


def _check_finite_before_save(step: int, state, metrics, ckpt: checkpoint.CheckpointManager) -> None:
    """Never save a diverged state: a NaN checkpoint would be resumed, and rotation would delete
    the finite ones. Reading one bool waits for this step, which the save does anyway."""
    if bool(jax.device_get(_finite(state.params, metrics))):
        return
    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
    ckpt.wait()
    good = ckpt.latest_step()
    raise NonFiniteLossError(
        f"step {step} diverged (" + ", ".join(f"{k}={host[k]:.4g}" for k in ("loss", "grad_norm", "param_norm")
                                              if k in host)
        + "): its state was not saved. The last finite checkpoint is "
        + (f"{ckpt.directory}/{good}" if good is not None else "none (this run saved nothing yet)")
        + "; lower optim.learning_rate (or check the data, or use model.dtype=float32) and rerun to resume from it")


def _end_outputs_missing(config, workdir: str) -> set[str]:
    """What a finished run's end should have written and did not (a crash between the last
    checkpoint and the export, an export that failed): ``{"eval", "export", "analysis"}`` subset."""
    todo = set()
    local = local_dir(workdir)
    if config.export_at_end and not os.path.isfile(os.path.join(export_dir(local, "final"), "config.json")):
        todo.add("export")
    if config.eval_at_end and not _has_eval_row(os.path.join(local, "metrics.jsonl"), config.num_train_steps):
        todo.add("eval")
    if config.analysis.enabled and config.export_at_end and \
            not os.path.isfile(os.path.join(local, "analysis", "self_similarity.json")):
        todo.add("analysis")
    return todo


def _has_eval_row(path: str, step: int) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("step") == step and any(k.startswith("eval_") for k in row):
                return True
    return False


def analyze_at_end(config, workdir: str, max_position_embeddings: int) -> dict | None:
    """The TaCL paper's isotropy analysis of the final export (and of ``init.hf_path`` with
    ``analysis.compare_init``) on held-out sentences: ``workdir/analysis/self_similarity.json``,
    ``self_similarity.png`` and ``cosine_heatmap.png``, and one log line. Skipped, with a log line
    saying why, when there is no export or no held-out text. Returns the report (None if skipped)."""
    from tacl_jax import analyze

    ac = config.analysis
    export = export_dir(local_dir(workdir), "final")
    if not config.export_at_end or not os.path.isdir(export):
        log.info("analysis skipped: it reads the final Hugging Face export (config.export_at_end=True)")
        return None
    try:
        sentences, source = analyze.heldout_sentences(config.data, max_sentences=ac.num_sentences,
                                                      seed=config.seed, scan_limit=20 * ac.num_sentences)
    except analyze.NoSentences as e:
        log.info("analysis skipped: no held-out sentences (%s)", e)
        return None
    t0 = time.perf_counter()
    entries = []
    if ac.compare_init and config.init.hf_path:
        entries.append(analyze.load_entry(config.init.hf_path, "init"))
    entries.append(analyze.load_entry(export, f"after {config.num_train_steps} steps ({config.objective})"))
    out = os.path.join(local_dir(workdir), "analysis")
    report = analyze.run_analysis(entries, sentences, out, max_len=min(ac.max_len, max_position_embeddings),
                                  batch_size=ac.batch_size, corpus=f"{source} (held-out)")
    if out != os.path.join(workdir, "analysis"):
        _copy_tree(out, os.path.join(workdir, "analysis"))
    run = report["models"][-1]["last_layer"]
    init = f" (init {report['models'][0]['last_layer']:.4f})" if len(entries) > 1 else ""
    log.info("analysis: last-layer self-similarity %.4f%s on %d held-out sentences, %.0fs -> %s "
             "(self_similarity.json, self_similarity.png, cosine_heatmap.png)", run, init, len(sentences),
             time.perf_counter() - t0, os.path.join(workdir, "analysis"))
    return report


def export_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "export", name)


def _export(model, params, workdir: str, name: str, tok_dir: str | None) -> None:
    out = export_dir(workdir, name)
    staging = export_dir(local_dir(workdir), name)
    # "ours": a rerun redoes an export it wrote (whole, atomically); a user's folder is refused.
    hf.save(model, params, staging, head="mlm", tokenizer_from=tok_dir or None, overwrite="ours")
    if staging != out and jax.process_index() == 0:
        _copy_tree(staging, out)
    log.info("exported the student as a Hugging Face BertForMaskedLM folder: %s", out)


class _Timer:
    """Step time, compile time and ETA from host timestamps between reports."""

    def __init__(self, start_step: int):
        self.t0 = time.perf_counter()
        self.compile_s = None
        self.t_last, self.step_last = None, start_step

    def compiled(self):
        # The first dispatch returns once the step is compiled (execution is asynchronous).
        self.compile_s = time.perf_counter() - self.t0


def _report(pending, writer: MetricWriter, config, timer: _Timer, flops: float, peak: float | None,
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
