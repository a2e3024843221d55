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
``CheckpointManager`` logs such leftovers and never deletes anything it does not understand.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)

ITEMS = ("state", "data", "config")
_STEP_DIR = re.compile(r"^\d+$")


class CheckpointError(RuntimeError):
    """A checkpoint directory that is not ours or is damaged."""


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(workdir, "checkpoints")


def _abs(path: str) -> str:
    # Orbax wants absolute paths; gs:// and friends are left alone.
    return path if "://" in path else os.path.abspath(path)


class PreemptionFlag:
    """SIGTERM (what Cloud TPU and SLURM send before taking a machine) sets a flag the loop reads
    at the next step boundary. With ``jax.distributed`` running, JAX's own preemption sync
    manager also sees the signal and Orbax's ``reached_preemption`` agrees across hosts."""

    def __init__(self):
        self.event = threading.Event()
        self._previous = None

    def install(self) -> "PreemptionFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):  # noqa: ARG002
        log.warning("SIGTERM received: saving a checkpoint at the next step boundary, then exiting")
        self.event.set()

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def is_set(self) -> bool:
        return self.event.is_set()


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
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        """``(state, data_state, config_dict)`` of ``step``; ``abstract_state`` carries the target
        shardings (``jax.ShapeDtypeStruct`` leaves), so a checkpoint restores onto any mesh."""
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} cannot be restored into this run's state "
                f"({type(e).__name__}: {str(e)[:300]}). It was written by a different model or "
                "optimizer config (e.g. another model.scan_layers: the layer layout differs), or is "
                "damaged; use another --workdir, or "
                "init.params_from to take only its params. Nothing was deleted.") from e
        return out.state, out.data, out.config

    def restore_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def abstract_like(tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct`` leaves with the given shardings: the restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
