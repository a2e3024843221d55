"""A run's start-up: the workdir lock, and the state it starts from (this workdir's checkpoint, a
Hugging Face checkpoint, another run's params, or the seed) with the teacher's initial params."""

from __future__ import annotations

import logging
from typing import Any

import jax

from tacl_jax import checkpoint, parallel
from tacl_jax import config as config_lib
from tacl_jax import workdir as workdir_lib

log = logging.getLogger(__name__)


def hold_workdir(workdir: str) -> workdir_lib.WorkdirLock:
    """Process 0 takes the workdir lock; every process learns whether it did (a refused process 0
    must not leave the others waiting in the first collective)."""
    lock = workdir_lib.WorkdirLock(workdir, enabled=jax.process_index() == 0)
    error = None
    try:
        lock.acquire()
    except workdir_lib.WorkdirError as e:
        error = e
    if jax.process_count() > 1:
        ok = parallel.process0_decides(error is None)
        if not ok and error is None:
            raise workdir_lib.WorkdirError(f"process 0 could not take the lock of {workdir} (see its log)")
    if error is not None:
        raise error
    return lock


def initial_state(config, prog, ckpt: checkpoint.CheckpointManager, workdir: str):
    """``(state, data_state | None, teacher_init | None)``: this workdir's latest good checkpoint (a
    changed config refused or warned about first), else ``init.hf_path``, ``init.params_from`` or
    from scratch. ``teacher_init``: host params the teacher starts from (None: the seed's, no teacher,
    or a teacher of its own), read only when the teacher is built from the student's."""
    abstract_state = prog.abstract_state
    # A teacher built from the student's initial params (none, or one of its own, needs none).
    from_student = prog.teacher_from_student
    latest = ckpt.latest_step()
    if latest is not None:
        _check_config_unchanged(ckpt, latest, config, workdir)
        step, state, data_state, saved = ckpt.restore_latest(abstract_state)
        log.info("start-up: resuming from %s/%d", ckpt.directory, step)
        if not from_student:
            return state, data_state, None
        # The teacher of a resumed run is re-read from where it came from (checkpoint docstring):
        # init.hf_path, or the saved run's init.params_from at the step the fresh start recorded.
        saved_init = (saved or {}).get("init", {})
        if not config.init.hf_path and saved_init.get("params_from"):
            _, teacher_params = _params_from(saved_init["params_from"], saved_init.get("params_from_step", -1),
                                             config, abstract_state)
            return state, data_state, teacher_params
        return state, data_state, prog.hf_params()
    if config.init.hf_path:
        log.info("start-up: no checkpoint in %s; student%s from the Hugging Face checkpoint %s",
                 ckpt.directory, " and teacher" if from_student else "", config.init.hf_path)
        hf_params = prog.hf_params()
        return prog.create_state_from_bert(hf_params), None, hf_params if from_student else None
    if config.init.params_from:
        step, params = _params_from(config.init.params_from, config.init.params_from_step, config, abstract_state)
        log.info("start-up: no checkpoint in %s; params from %s step %d (optimizer state and step reset)",
                 ckpt.directory, config.init.params_from, step)
        with config.unlocked():
            config.init.params_from_step = step      # saved with every checkpoint: the teacher on resume
        return prog.create_state(params), None, params
    log.info("start-up: no checkpoint in %s and no init.hf_path: from scratch (seed %d)",
             ckpt.directory, config.seed)
    return prog.create_state(), None, None


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
