"""Orbax checkpoints that survive a pod: async saves, interval + preemption policies, exact resume.

A checkpoint at step s holds three items:

* ``state``: the student's ``TrainState`` (params, optimizer state, step), saved sharded — every
  host writes its own shards; restored onto whatever mesh the new run has;
* ``data``: the input iterator's state (JSON; the batch at step s is a pure function of
  (seed, s), so this is essentially s plus the data settings, checked on restore);
* ``config``: the config as run (JSON), what ``tacl_jax.convert`` rebuilds the model from.

The frozen teacher is never saved: it is re-read from where it came from (``init.hf_path``) or,
from scratch, re-initialised from the seed, which reproduces it bit for bit.

Atomicity is Orbax's: a step is written under a temporary name and renamed when complete, so a
kill during an async save leaves a temporary directory that ``latest_step`` never returns.
``CheckpointManager`` logs such leftovers and never deletes anything it does not understand. A
complete but damaged step (a truncated array file: a bad disk, a copy cut short) is found when
restoring it fails while the step before restores: it is moved to ``workdir/checkpoints_damaged/``
(kept for inspection, out of Orbax's way) and the run resumes from the step before, loudly. A save
that fails (disk full) ends the run with one line naming the last good checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
import traceback
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from tacl_jax.errors import UserError

log = logging.getLogger(__name__)

ITEMS = ("state", "data", "config")
_STEP_DIR = re.compile(r"^\d+$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint directory that is not ours or is damaged."""


class CheckpointWriteError(CheckpointError):
    """A save failed (disk full, permissions, quota): the message names the last good checkpoint."""


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(workdir, "checkpoints")


def _abs(path: str) -> str:
    # Orbax wants absolute paths; gs:// and friends are left alone.
    return path if "://" in path else os.path.abspath(path)


class CheckpointManager:
    """Thin wrapper over ``ocp.CheckpointManager`` with this run's items and policies.

    ``ckpt_cfg`` is ``config.checkpoint``: ``every`` (interval steps; 0 = only at the end and on
    preemption), ``keep`` (the N most recent), ``keep_every`` (also keep every K-th step
    permanently; 0 = off), ``async_save``.
    """

    def __init__(self, workdir: str, ckpt_cfg: ml_collections.ConfigDict):
        self.directory = _abs(checkpoint_dir(workdir))
        self._check_directory()
        P = ocp.checkpoint_managers
        save_policies = [P.PreemptionCheckpointingPolicy()]
        if ckpt_cfg.every > 0:
            save_policies.insert(0, P.FixedIntervalPolicy(interval=int(ckpt_cfg.every)))
        keep = [P.LatestN(n=max(1, int(ckpt_cfg.keep)))]
        if ckpt_cfg.keep_every > 0:
            keep.append(P.EveryNSteps(interval_steps=int(ckpt_cfg.keep_every)))
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=P.AnySavePolicy(save_policies),
            preservation_policy=P.AnyPreservationPolicy(keep),
            enable_async_checkpointing=bool(ckpt_cfg.async_save),
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    def _check_directory(self) -> None:
        """Refuse a directory that holds something other than our checkpoints; report leftovers of
        interrupted saves (they are ignored, never deleted)."""
        path = epath.Path(self.directory)
        if not path.exists():
            return
        if not path.is_dir():
            raise CheckpointError(f"{self.directory} exists and is not a directory; choose another --workdir")
        for child in path.iterdir():
            name = child.name
            if _STEP_DIR.match(name):
                items = {c.name for c in child.iterdir()} if child.is_dir() else set()
                if child.is_dir() and not (items & set(ITEMS)) and "_CHECKPOINT_METADATA" not in items:
                    raise CheckpointError(
                        f"{child} is not a tacl_jax checkpoint (it has {sorted(items) or 'nothing'}); "
                        f"move it away or use another --workdir. Nothing was deleted.")
            elif "tmp" in name:
                log.warning("ignoring %s: the leftover of a save that did not complete "
                            "(the run falls back to the last complete checkpoint)", child)

    # ------------------------------------------------------------------------- queries
    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return self.manager.should_save(step)

    def reached_preemption(self, step: int) -> bool:
        return self.manager.reached_preemption(step)

    # ------------------------------------------------------------------------- save / restore
    def save(self, step: int, state: Any, data_state: dict, config: ml_collections.ConfigDict,
             force: bool = False) -> bool:
        """Start an (async) save of step ``step``; returns whether one was started."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(json.loads(config.to_json_best_effort())))
        try:
            return self.manager.save(step, args=args, force=force)
        except Exception as e:  # pylint: disable=broad-except  # OSError, or Orbax wrapping it
            raise self._write_error(step, e) from e

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        """``(state, data_state, config_dict)`` of ``step``; ``abstract_state`` carries the target
        shardings (``jax.ShapeDtypeStruct`` leaves), so a checkpoint restores onto any mesh."""
        _drop_late_read_completions()   # before: Orbax closes its loop before its error reaches us
        _drop_unretrieved_read_errors()
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore()))
        except Exception as e:  # pylint: disable=broad-except  # TensorStore/Orbax errors have many types
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} cannot be restored into this run's state "
                f"({type(e).__name__}: {str(e)[:300]}). It was written by a different model or "
                "optimizer config (e.g. another model.scan_layers: the layer layout differs), or is "
                "damaged; use another --workdir, or "
                "init.params_from to take only its params. Nothing was deleted.") from e
        return out.state, out.data, out.config

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict, dict] | None:
        """``(step, state, data_state, config_dict)`` of the newest step that restores, or None when
        there is no checkpoint. When the newest fails but the one before restores, the newest is
        damaged: it is moved to ``checkpoints_damaged/`` and the step before is used, with a warning.
        When both fail the newest's error is raised (a different config, most likely)."""
        steps = sorted(self.all_steps())
        if not steps:
            return None
        try:
            return (steps[-1], *self.restore(steps[-1], abstract_state))
        except CheckpointError as newest_error:
            if len(steps) < 2:
                raise
            try:
                out = self.restore(steps[-2], abstract_state)
            except CheckpointError:
                raise newest_error from None
            moved = self._move_damaged(steps[-1], steps[-2])
            log.warning("CHECKPOINT %s/%d IS DAMAGED (%s) while %d restores: it was moved to %s and the run "
                        "resumes from step %d (the steps after it are redone)", self.directory, steps[-1],
                        _root_cause(newest_error.__cause__ or newest_error), steps[-2], moved, steps[-2])
            return (steps[-2], *out)

    def _move_damaged(self, step: int, previous: int) -> str:
        """Move ``checkpoints/<step>`` to ``checkpoints_damaged/<step>-<time>`` (process 0; the
        others wait), so that the step can be saved again. Nothing is deleted."""
        src = os.path.join(self.directory, str(step))
        dst = os.path.join(os.path.dirname(self.directory), "checkpoints_damaged",
                           f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        if jax.process_index() == 0:
            if "://" in src:   # object stores have no rename; a copy of a damaged tree is the user's call
                raise CheckpointError(f"{src} is damaged while step {previous} restores: move {src} out of "
                                      f"{self.directory} (e.g. gsutil -m mv) and rerun to resume from {previous}")
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.move(src, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"tacl_jax_moved_damaged_{step}")
        self.manager.reload()
        return dst

    def restore_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config

    def wait(self) -> None:
        """Block until the async save in flight is on disk (its errors surface here)."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # pylint: disable=broad-except
            raise self._write_error(None, e) from e

    def _write_error(self, step: int | None, e: BaseException) -> CheckpointWriteError:
        try:
            self.manager.reload()
            good = self.manager.latest_step()
        except Exception:  # pylint: disable=broad-except  # the disk may be unreadable too
            good = None
        last = f"{self.directory}/{good}" if good is not None else "none (nothing was saved)"
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        cause = _root_cause(e)
        return CheckpointWriteError(
            f"{what} could not be written to {self.directory}: {cause}. The last good checkpoint is {last}; "
            "free space (or fix the folder's permissions) and rerun the same command to resume from it.")

    def close(self) -> None:
        self.manager.close()


def _is_late_read_completion(unraisable: Any) -> bool:
    """Whether an unraisable is a TensorStore read finishing after Orbax closed its event loop:
    ``RuntimeError('Event loop is closed')`` raised in asyncio's ``call_soon_threadsafe``."""
    return (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
            and any(frame.f_code.co_name == "call_soon_threadsafe"
                    for frame, _ in traceback.walk_tb(unraisable.exc_traceback)))


def _drop_late_read_completions() -> None:
    """Silence the completions of a failed restore's reads still in flight.

    Orbax runs a restore's reads on a fresh asyncio loop and closes that loop as soon as the first
    read fails (a truncated file); each read that completes afterwards calls the closed loop's
    ``call_soon_threadsafe`` from a TensorStore thread, and Python prints that ``RuntimeError``
    with a traceback through ``sys.unraisablehook`` (about two per failed restore of a 40-array
    tree, after our one-line warning or error). They carry nothing: the restore already
    failed and was reported. This wraps the current hook once, dropping exactly those and passing
    every other unraisable on. A restore installs it before it starts: the first completions can
    arrive between Orbax closing its loop and its error reaching our ``except``."""
    previous = sys.unraisablehook
    if getattr(previous, "_tacl_jax_drops_late_reads", False):
        return

    def hook(unraisable):
        if not _is_late_read_completion(unraisable):
            previous(unraisable)

    hook._tacl_jax_drops_late_reads = True   # pylint: disable=protected-access
    sys.unraisablehook = hook


def _keeps_asyncio_record(record: logging.LogRecord) -> bool:
    """False for a failed restore's read that nobody awaited: "Task (or Future) exception was never
    retrieved" for a TensorStore error (a ``ValueError`` naming its spec); True for every other record."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(record.msg, str)
                and record.msg.startswith(("Task exception was never retrieved",
                                           "Future exception was never retrieved"))
                and isinstance(exc, ValueError) and "tensorstore_spec=" in str(exc))


def _drop_unretrieved_read_errors() -> None:
    """Silence the other half of a failed restore's teardown: its reads that failed too.

    When the first read of a damaged checkpoint fails, Orbax stops waiting for the rest; those that
    also fail (every array of a truncated step does) end as asyncio tasks or futures whose error is
    never retrieved. When they are garbage-collected (often at interpreter exit), asyncio logs each
    with a TensorStore traceback, long after our one-line warning or error named the damage. This
    puts ``_keeps_asyncio_record`` on the ``asyncio`` logger (``addFilter`` adds a filter once),
    dropping exactly those records. A restore installs it before it starts."""
    logging.getLogger("asyncio").addFilter(_keeps_asyncio_record)


def _root_cause(e: BaseException) -> str:
    """The innermost exception's type and first line: what Orbax/TensorStore wrapped."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:240] if str(e).strip() else ''}"


def abstract_like(tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct`` leaves with the given shardings: the restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
