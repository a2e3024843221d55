"""``config.profile_steps``: a ``jax.profiler`` trace of a window of training steps."""

from __future__ import annotations

import glob
import logging
import os

import jax

from tacl_jax import config as config_lib
from tacl_jax.train import outputs

log = logging.getLogger(__name__)


class Profiler:
    """``config.profile_steps='START,STOP'``: a ``jax.profiler`` trace of the steps that take the
    state from step START to step STOP, on process 0, in ``workdir/profile/`` (written to the local
    mirror and copied for a remote workdir). The trace starts before step START is dispatched and
    stops once the last profiled step's outputs are ready (so its device work is in the trace) —
    at STOP, or earlier when the run ends, pauses or is preempted inside the window (``last``);
    ``close()`` stops a trace an exception left open. A resumed run traces what is left of the window."""

    def __init__(self, config, workdir: str, start_step: int):
        window = config_lib.parse_profile_steps(config.get("profile_steps", ""))
        self.window = window if jax.process_index() == 0 else None
        self.workdir, self.local = workdir, os.path.join(outputs.local_dir(workdir), "profile")
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
                outputs.copy_tree(self.local, target)
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
