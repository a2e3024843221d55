"""The run's workdir: checked before anything is compiled, and held by one run at a time.

Two runs on one workdir corrupt each other: started together both die in Orbax, started minutes
apart both "finish" with their metrics interleaved. ``WorkdirLock`` is a file, ``workdir/LOCK``,
created atomically (``O_EXCL``) by process 0 and holding who owns it (host, pid, start time); a
second run is refused with the holder's name. A lock left by a process that died (SIGKILL, a lost
machine) is taken over with a log line: on the same host when its pid is gone, on another host when
its heartbeat (the file's mtime, touched every ``HEARTBEAT_S``) is older than ``STALE_S``.

Remote workdirs (``gs://``) have no atomic create: there the lock is written and read back, which
catches runs started seconds apart but not a true race (the usual launchers start one run).
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import socket
import threading
import time

from tacl_jax.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
HEARTBEAT_S = 60.0
STALE_S = 600.0


class WorkdirError(UserError):
    """The workdir cannot be used (a file, not writable, held by another run)."""


def check_writable(workdir: str) -> None:
    """Create ``workdir`` (local) and prove it writable now, not after minutes of compiling."""
    if "://" in workdir:
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"--workdir={workdir} is a file, not a folder; choose another --workdir")
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(f"--workdir={workdir} is not writable ({e.strerror}); fix its permissions or "
                           "free space, or choose another --workdir") from e


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, owned by another user
        return True
    return True


class WorkdirLock:
    """``with WorkdirLock(workdir): ...`` — see the module docstring. ``enabled=False`` (processes
    other than 0) makes it a no-op."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.path = os.path.join(workdir, LOCK_NAME)
        self.enabled = enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.me = dict(host=socket.gethostname(), pid=os.getpid(),
                       started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> "WorkdirLock":
        if not self.enabled:
            return self
        for _ in range(3):   # a stale lock removed by us (or by a racing run) is retried
            if self._create():
                self._start_heartbeat()
                return self
            holder, age = self._read()
            if holder is None:
                continue   # removed between our create and read
            if self._stale(holder, age):
                log.warning("taking over the workdir lock %s left by a run that is gone (%s); "
                            "its checkpoints are resumed as usual", self.path, _describe(holder, age))
                self._remove()
                continue
            raise WorkdirError(
                f"another run holds this workdir ({_describe(holder, age)}; lock file {self.path}). Wait for it "
                "to finish, stop it, or choose another --workdir; if that run is gone for sure, delete the "
                "lock file and rerun.")
        raise WorkdirError(f"could not take the workdir lock {self.path}: other runs keep creating it")

    def release(self) -> None:
        if not self.enabled:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder, _ = self._read()
        if holder is not None and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            self._remove()

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------ the file
    def _create(self) -> bool:
        payload = json.dumps(self.me).encode()
        if "://" in self.path:
            from etils import epath
            p = epath.Path(self.path)
            if p.exists():
                return False
            p.write_bytes(payload)
            return json.loads(p.read_bytes()).get("pid") == self.me["pid"]
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise WorkdirError(f"cannot create the workdir lock {self.path} ({e.strerror}); "
                               "is the workdir writable?") from e
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        return True

    def _read(self) -> tuple[dict | None, float]:
        """(holder, seconds since its last heartbeat), or (None, 0) when there is no lock."""
        try:
            if "://" in self.path:
                from etils import epath
                p = epath.Path(self.path)
                text, mtime = p.read_text(), p.stat().mtime
            else:
                with open(self.path) as f:
                    text = f.read()
                mtime = os.path.getmtime(self.path)
        except (FileNotFoundError, OSError) as e:
            if isinstance(e, FileNotFoundError) or getattr(e, "errno", None) == errno.ENOENT:
                return None, 0.0
            raise
        try:
            holder = json.loads(text)
        except ValueError:
            holder = {"host": "?", "pid": -1, "started": "?", "damaged": text[:80]}
        return holder, max(0.0, time.time() - mtime)

    def _stale(self, holder: dict, age: float) -> bool:
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            return holder["pid"] <= 0 or not _pid_alive(holder["pid"])
        return age > STALE_S

    def _remove(self) -> None:
        try:
            if "://" in self.path:
                from etils import epath
                epath.Path(self.path).unlink()
            else:
                os.remove(self.path)
        except FileNotFoundError:
            pass

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    if "://" in self.path:
                        from etils import epath
                        epath.Path(self.path).write_bytes(json.dumps(self.me).encode())
                    else:
                        os.utime(self.path)
                except OSError:   # a full disk must not end training; the lock only looks older
                    pass

        self._thread = threading.Thread(target=beat, name="workdir-lock-heartbeat", daemon=True)
        self._thread.start()


def _describe(holder: dict, age: float) -> str:
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}, "
            f"last heartbeat {age:.0f} s ago")
