"""The host process's memory allocator: glibc malloc tuned so XLA's per-step buffers are reused.

Why. XLA:CPU allocates a step's temporary buffer (the activations: ~430 MB at the ``small`` bench
size, 1.1 GB at ``base``) with ``malloc`` at every execution and frees it at the end. glibc serves
an allocation that large with a fresh ``mmap`` and gives it back with ``munmap``, so every step the
kernel faults in and zeroes the whole buffer again (measured: 1.24 M minor faults for 9 steps of
``small`` bf16). Three glibc tunables remove most of that:

* ``glibc.malloc.mmap_max=0``: no allocation is served by its own ``mmap``; big buffers come from
  the heap, where a freed block is reused by the next step (from the main arena; XLA's threads'
  arenas still map theirs, see "One arena");
* ``glibc.malloc.trim_threshold`` (64 GiB): the heap is never trimmed back to the kernel between
  steps (peak RSS is what the step needs; a training process keeps it anyway);
* ``glibc.malloc.hugetlb=1``: heap growth is ``madvise``-d for transparent huge pages, so what is
  still faulted in (the first step, growth) comes in 2 MiB pages.

**One arena** (``TACL_MALLOC_TUNING=one_arena``, opt-in): ``glibc.malloc.arena_max=1`` on top. XLA
runs a step on its own threads, and a thread's secondary arena is made of 64 MiB heaps: a bigger
block cannot come from one, so glibc still falls back to ``mmap`` for it *despite* ``mmap_max=0``.
Seen with ``strace`` at ``base`` fp32: one 1,176,035,328-byte ``mmap`` + ``munmap`` per step, ~1,000
(huge-page) faults, 0.4-0.8 s of kernel time per ~4.5 s step. With one arena every thread allocates
from the main heap: after the first two steps no fault and no kernel time (``base`` fp32 1.15-1.28x
tokens/s in interleaved pairs on a busy host). Why not the default: in the main heap the freed
step buffer is often split by a small allocation before the next step asks for it again, the heap
then grows by one more step buffer, and peak RSS rose by up to that much (measured: ``small`` fp32
~1,300 -> 1,718 MB, ``small`` bf16 ~1,300 -> 1,539 MB, ``base`` bf16 ~3,640 -> 4,585 MB: 4 of 8
processes of one bench run; the others were equal or lower). Take it where the CPU step's speed
matters more than one step buffer of RAM.

Measured on a 2-core Sapphire Rapids VM (``bench/step_throughput.py --malloc``): the ``small``
bf16 step 0.69 s -> 0.50 s, and the PyTorch peer gains too, which is why the bench runs both with
the same allocator. Tunables are read by glibc at process start only, so ``python -m
tacl_jax.main`` re-executes itself once with them (``maybe_reexec``); a process that already set
``GLIBC_TUNABLES`` (or preloads tcmalloc/jemalloc), non-glibc systems, and
``TACL_MALLOC_TUNING=off`` are left alone.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping

TUNABLES = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
ONE_ARENA = "glibc.malloc.arena_max=1"  # added by TACL_MALLOC_TUNING=one_arena (see the module doc)
SWITCH = "TACL_MALLOC_TUNING"          # 'auto' (default) | 'one_arena' | 'off'
_MARK = "TACL_MALLOC_TUNED"            # set in the re-executed process: never loop


def tunables(switch: str = "auto") -> str:
    """The ``GLIBC_TUNABLES`` value of a ``TACL_MALLOC_TUNING`` setting: 'auto' -> ``TUNABLES``,
    'one_arena' -> those and ``ONE_ARENA``."""
    return TUNABLES + ":" + ONE_ARENA if switch == "one_arena" else TUNABLES


def tuned_env(environ: Mapping[str, str], libc: tuple[str, str] | None = None) -> dict[str, str] | None:
    """The environment to re-execute with, or None when nothing should change. Pure.

    ``libc``: ``platform.libc_ver()`` (default: this process's). The switch ``TACL_MALLOC_TUNING``
    ('auto' | 'one_arena' | 'off') picks the value (``tunables``). Nothing changes when the switch
    is 'off', when the process was already re-executed, when ``GLIBC_TUNABLES`` is set (the
    user's own choice wins), when an allocator is preloaded (``LD_PRELOAD`` names malloc), or when
    the C library is not glibc.
    """
    switch = environ.get(SWITCH, "auto").strip().lower()
    if switch not in ("auto", "one_arena", "off"):
        raise ValueError(f"{SWITCH}={environ[SWITCH]!r}: use 'auto', 'one_arena' or 'off'")
    if switch == "off" or environ.get(_MARK) or environ.get("GLIBC_TUNABLES"):
        return None
    if "malloc" in environ.get("LD_PRELOAD", ""):
        return None
    name, _ = libc if libc is not None else platform.libc_ver()
    if name != "glibc":
        return None
    return {**environ, "GLIBC_TUNABLES": tunables(switch), _MARK: "1"}


def describe(environ: Mapping[str, str]) -> str:
    """One line for the start-up log: which allocator this process runs with."""
    if environ.get(_MARK):
        one = ONE_ARENA in environ.get("GLIBC_TUNABLES", "")
        return f"glibc malloc tuned{', one arena' if one else ''} (GLIBC_TUNABLES, see tacl_jax.hostenv)"
    if environ.get(SWITCH, "").strip().lower() == "off":
        return f"system default ({SWITCH}=off)"
    if environ.get("GLIBC_TUNABLES"):
        return f"GLIBC_TUNABLES={environ['GLIBC_TUNABLES']} (set by the caller)"
    if "malloc" in environ.get("LD_PRELOAD", ""):
        return f"preloaded {environ['LD_PRELOAD']}"
    return "system default"


def maybe_reexec(module: str) -> None:
    """Re-executes ``python -m module <argv>`` with the tuned allocator (see the module doc) when
    ``tuned_env`` says so; returns only when nothing was changed. Call it first thing in a
    ``__main__`` block, before jax is imported (the exec replaces the process)."""
    env = tuned_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def page_faults_of_reuse(nbytes: int = 256 << 20, in_thread: bool = False) -> int:
    """Minor page faults of touching a fresh ``nbytes`` malloc after an equal one was freed: ~0
    when the allocator reuses the block, ``nbytes / 4 KiB`` when it maps new memory (glibc's
    default; ``nbytes / 2 MiB`` where the new mapping gets transparent huge pages). ``in_thread``: measured on a new thread, as XLA allocates (a thread arena of its own
    unless ``arena_max=1``, see the module doc). Linux/glibc only; what ``python -m
    tacl_jax.hostenv`` reports."""
    import ctypes
    import resource
    import threading

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    result = []

    def measure():
        # RUSAGE_THREAD (Linux) counts this thread's faults only.
        usage = lambda: resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt
        first = libc.malloc(nbytes)
        ctypes.memset(first, 1, nbytes)
        libc.free(first)
        before = usage()
        again = libc.malloc(nbytes)
        ctypes.memset(again, 1, nbytes)
        result.append(usage() - before)
        libc.free(again)

    if in_thread:
        worker = threading.Thread(target=measure)
        worker.start()
        worker.join()
    else:
        measure()
    return result[0]


if __name__ == "__main__":
    # `python -m tacl_jax.hostenv`: re-executes as the training entry point does, then reports.
    maybe_reexec("tacl_jax.hostenv")
    import json

    print(json.dumps({"GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES"), "reexecuted": bool(os.environ.get(_MARK)),
                      "libc": "-".join(platform.libc_ver()), "page_faults_256mb_reuse": page_faults_of_reuse(),
                      "page_faults_256mb_reuse_thread": page_faults_of_reuse(in_thread=True)}))
