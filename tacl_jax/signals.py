"""SIGTERM and Ctrl-C stop a run at the next step boundary, with a checkpoint.

Cloud TPU maintenance, ``launch/tpu_vm.sh stop`` and SLURM (``--signal=TERM@300``) send SIGTERM
before taking a machine; a user at a terminal presses Ctrl-C. Both set one flag that the loop
reads after each step: it saves, and the process exits 0. A second Ctrl-C exits at once.

With several processes (``jax.distributed``) a signal usually reaches one process, or all of them
at different steps: each stopping on its own would leave the others waiting in a collective. There
JAX's preemption notifier (installed by ``jax.distributed.initialize``) must own SIGTERM, so that
Orbax's ``reached_preemption`` agrees on one step for every process; a Python handler would
replace JAX's C handler and that agreement would never happen. So ``install`` leaves SIGTERM to
JAX once ``jax.distributed`` is initialized (a Ctrl-C then interrupts at once, as usual).

This module imports only the standard library: ``tacl_jax.main`` installs it before anything slow,
so that a SIGTERM during start-up (imports, compiling) is said and exits 0 instead of killing the
process (143).
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGTERM (single process) or Ctrl-C; read by the loop at step boundaries."""

    def __init__(self):
        self.event = threading.Event()
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._interrupts = 0
        self.multi_process = False

    def install(self, multi_process: bool = False) -> "StopFlag":
        """Handle SIGTERM and Ctrl-C in a single-process run. With several processes, handle nothing:
        SIGTERM belongs to JAX's notifier (see the module docstring; its C handler, installed by
        ``jax.distributed.initialize`` after ours, already replaced ours, and calling
        ``signal.signal`` now would remove it) and Ctrl-C interrupts as usual. Only the main thread
        can install handlers; elsewhere (a test's thread) this does nothing."""
        if threading.current_thread() is not threading.main_thread():
            return self
        if multi_process:
            if signal.SIGINT in self._previous:
                signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))
            self._previous.pop(signal.SIGTERM, None)
            self.multi_process = True
            return self
        for s in (signal.SIGINT, signal.SIGTERM):
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):  # noqa: ARG002
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt("second Ctrl-C: exiting without a checkpoint")
            log.warning("Ctrl-C: saving a checkpoint at the next step boundary, then exiting "
                        "(press Ctrl-C again to exit at once, without it)")
        else:
            log.warning("%s received: saving a checkpoint at the next step boundary, then exiting", name)
        self.signal_name = self.signal_name or name
        self.event.set()

    def is_set(self) -> bool:
        """Whether this process should stop at this step boundary on its own (never with several
        processes: there ``CheckpointManager.reached_preemption`` decides for all of them)."""
        return self.event.is_set() and not self.multi_process

    def reset(self) -> None:
        """After a run has acted on the flag (saved and returned): the next run in this process
        (tests, notebooks) starts unset."""
        self.event.clear()
        self.signal_name, self._interrupts = None, 0

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()


# One flag per process: main installs it before the slow imports, the loop reads the same one.
STOP = StopFlag()


def install(multi_process: bool = False) -> StopFlag:
    return STOP.install(multi_process)

