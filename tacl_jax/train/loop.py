"""The training loop, read top to bottom: start-up → the program → input → state → the loop → the end.

``train_and_evaluate(config, workdir)`` is what ``python -m tacl_jax.main`` runs. The jitted step
and everything the objective decides come from ``setup.build_program``; the start-up state from
``start``; metrics, profiling and end-of-run outputs from their modules.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tacl_jax import checkpoint, parallel, signals
from tacl_jax import config as config_lib
from tacl_jax import data as data_lib
from tacl_jax import workdir as workdir_lib
from tacl_jax.train import outputs, start as start_lib
from tacl_jax.train.metrics import MetricWriter, NonFiniteLossError, Timer, evaluate, report
from tacl_jax.train.profiling import Profiler
from tacl_jax.train.setup import build_program, run_devices

log = logging.getLogger(__name__)


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
    lock = start_lib.hold_workdir(workdir)
    try:
        return _train(config, workdir, stop)
    finally:
        lock.release()
        stop.reset()
        stop.uninstall()


def _train(config, workdir: str, stop: signals.StopFlag) -> dict[str, Any]:
    # --- the program: mesh, model, step config, optimizer, shardings and the jitted step, decided
    # from this run's devices (tacl_jax.train.setup; python -m tacl_jax.aot compiles the same)
    prog = build_program(config, run_devices(config))
    mesh, rules, model = prog.mesh, prog.rules, prog.model
    log.info("mesh %s: %d process(es) × %d local device(s) (%s); global batch %d = %d per process, %d micro-batch(es)",
             dict(mesh.shape), jax.process_count(), jax.local_device_count(), prog.target.device_kind,
             config.global_batch_size, config.global_batch_size // jax.process_count(), config.grad_accum_steps)
    tok_dir = config.init.tokenizer_path or config.init.hf_path

    # --- input (before the checkpoint folder exists: a refused data config leaves nothing behind)
    data_kwargs = dict(global_batch_size=config.global_batch_size, max_len=config.max_len, seed=config.seed,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       tokenizer_dir=tok_dir or None, vocab_size=model.config.vocab_size,
                       special_ids=prog.special_ids, with_nsp=config.nsp)
    train_iter = data_lib.make_train_iterator(config.data, **data_kwargs)
    eval_batches = []
    if config.eval_every > 0 or config.eval_at_end:
        eval_batches = data_lib.make_eval_batches(config.data, num_batches=config.eval_batches, **data_kwargs)

    # --- state: this workdir's checkpoint → init.hf_path → init.params_from → from scratch.
    # Every start-up check above has passed: only now is workdir/checkpoints created.
    ckpt = checkpoint.CheckpointManager(workdir, config.checkpoint)
    try:
        state, data_state, teacher_init = start_lib.initial_state(config, prog, ckpt, workdir)
    except BaseException:
        ckpt.close()
        train_iter.close()
        raise
    start = int(jax.device_get(state.step))
    todo = outputs.end_outputs_missing(config, workdir) if start >= config.num_train_steps else None
    if todo is not None and not todo:
        log.info("this run already finished: step %d of %d is checkpointed in %s and its end-of-run outputs "
                 "are there; nothing to do", start, config.num_train_steps, ckpt.directory)
        ckpt.close()
        train_iter.close()
        return {"state": state, "metrics": {}, "model": model, "status": "already_finished"}
    if todo:
        log.info("this run already finished training (step %d) but its end is incomplete: redoing %s",
                 start, ", ".join(sorted(todo)))

    # The frozen teacher (None without one; not needed when only the export is left to redo).
    teacher = prog.create_teacher(teacher_init) if todo is None or "eval" in todo else None
    del teacher_init
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

    # --- loop; metrics are fetched one step late so the host never waits on the device.
    writer = MetricWriter(workdir, resumed_at=start, console_keys=prog.objective.console_keys)
    pending, last, status = None, {}, "finished"
    timer = Timer(start)
    profiler = Profiler(config, workdir, start)
    step = start
    if stop.is_set():
        status = "preempted"
        log.warning("%s during start-up: stopping before the first step; nothing new to save (the "
                    "checkpoint of step %d is the latest)", stop.signal_name, start)
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            # A stop between a step's checkpoint and its hf_export_every export resumes here with
            # that export missing: write it now from the restored state (the same params). Not
            # after a stop during start-up: that run exits at once, and its resume comes here again.
            if status == "finished" and parallel.process0_decides(outputs.step_export_missing(config, workdir, start)):
                log.info("redoing the export of step %d (the run stopped after its checkpoint, before "
                         "its hf_export_every export)", start)
                outputs.export(prog.export_model, prog.export_params(state.params), workdir, f"step_{start}", tok_dir)
            for step in range(start, config.num_train_steps if status == "finished" else start):
                batch = prog.global_batch(next(train_iter))
                profiler.before_step(step)
                state, metrics = p_step(state, teacher, batch, rng)
                if step == start:
                    timer.compiled()
                if pending is not None:
                    last = report(pending, writer, config, timer, flops, peak) or last
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
                    outputs.export(prog.export_model, prog.export_params(state.params), workdir, f"step_{done}", tok_dir)
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
                last = report(pending, writer, config, timer, flops, peak, force=True) or last
            evaluated_last = config.eval_every > 0 and step + 1 == config.num_train_steps and \
                config.num_train_steps % config.eval_every == 0
            if status == "finished" and config.eval_at_end and eval_batches and not evaluated_last and \
                    (todo is None or "eval" in todo):
                writer.write(config.num_train_steps, evaluate(p_eval, state.params, teacher, eval_batches, mesh,
                                                              config.seed + 1, eval_ratios), config.num_train_steps, prefix="eval_")
            if status == "finished" and config.export_at_end and (todo is None or "export" in todo):
                outputs.export(prog.export_model, prog.export_params(state.params), workdir, "final", tok_dir)
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
            outputs.analyze_at_end(config, workdir, prog.export_model.config.max_length)
        except Exception:  # pylint: disable=broad-except  # the run is complete and saved either way
            log.exception("analysis failed (training, checkpoint and export are complete); rerun it with "
                          "python -m tacl_jax.analyze --workdir=%s --split=heldout --out=...", workdir)
    if todo:
        status = "already_finished"
    return {"state": state, "metrics": last, "model": model, "status": status}


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
