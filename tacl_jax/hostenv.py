"""The host process's memory allocator: glibc malloc tuned, and big blocks kept for reuse.

Why: XLA:CPU ``malloc``s a step's temporary buffer at every execution and frees it at the end;
glibc serves a block that large with a fresh ``mmap``, so every step the kernel faults in and
zeroes the whole buffer again. Two parts, both on by default (``TACL_MALLOC_TUNING=auto``):

1. **glibc tunables** (``TUNABLES``: ``mmap_max=0``, a 64 GiB ``trim_threshold``, ``hugetlb=1``),
   so the main thread's freed big blocks stay in the heap for the next step.
2. **bigalloc** (``tacl_jax/bigalloc.c``, an ``LD_PRELOAD`` shim compiled once with the system's C
   compiler into ``~/.cache/tacl_jax``) for XLA's threads, whose 64 MiB arena heaps make glibc map
   and unmap big blocks despite ``mmap_max=0``: every request of >= 64 MiB made off the main
   thread gets a mapping of its own, kept when freed for the next request it fits.

Allocator settings are read at process start only, so ``python -m tacl_jax.main`` re-executes itself
once with them (``maybe_reexec``). Left alone: ``TACL_MALLOC_TUNING=off``, a process that already set
``GLIBC_TUNABLES`` or preloads an allocator (tcmalloc/jemalloc), non-glibc systems.
``TACL_MALLOC_TUNING=glibc`` takes the tunables without bigalloc (also what ``auto`` falls back to
where no C compiler works). bigalloc's knobs: ``TACL_BIGALLOC_MIN_MB`` (64), ``TACL_BIGALLOC_CACHE_MB``
(4096: freed blocks kept at most), ``TACL_BIGALLOC_WAIT_US`` (5000).

Only for XLA:CPU: ``auto`` tunes nothing where the run will use TPU or GPU devices, decided before
jax is imported (``run_platform``: ``JAX_PLATFORMS``' first entry, else the TPU/GPU device files an
installed jax plugin can drive, else CPU); the log's ``allocator:`` line says which and why.
``glibc`` is an explicit request and applies the tunables whatever the platform.

The measurements (strace, page faults, step times) and what was tried instead: docs/allocator.md.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Mapping

TUNABLES = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
SWITCH = "TACL_MALLOC_TUNING"          # 'auto' (default: tunables + bigalloc on CPU runs) | 'glibc' (tunables) | 'off'
_MARK = "TACL_MALLOC_TUNED"            # set in the re-executed process: never loop
# Every variable tuned_env reads or sets: a caller that picks the allocator itself (the bench's
# workers) clears these first.
ALLOCATOR_VARS = ("GLIBC_TUNABLES", "LD_PRELOAD", _MARK, SWITCH)
BIGALLOC_SOURCE = Path(__file__).with_name("bigalloc.c")


# JAX_PLATFORMS names (jax's aliases) -> the platform; another name (a plugin's) stands for itself.
_PLATFORM_NAMES = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}
# GPU device files -> the variable that hides them when '' or -1, and the plugin name part jax needs.
_GPU_DEVICES = ((re.compile(r"nvidia\d+|dxg"), "CUDA_VISIBLE_DEVICES", "cuda"),   # dxg: WSL2
                (re.compile(r"kfd"), "HIP_VISIBLE_DEVICES", "rocm"))
_TPU_DEVICES = re.compile(r"accel\d+|vfio/\d+")   # Cloud TPU VMs: v2-v4 accel<n>, v5e and later vfio/<n>


def dev_entries(root: str = "/dev") -> list[str]:
    """The names under ``root`` (``/dev``), and ``vfio/<name>`` for those under ``root/vfio``: what
    ``run_platform`` reads."""
    names = []
    for sub in ("", "vfio"):
        try:
            names += [os.path.join(sub, n) for n in os.listdir(os.path.join(root, sub))]
        except OSError:
            pass
    return names


def jax_plugins(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The accelerator platforms jax could drive here, found without importing jax (which must not
    be imported before the re-exec): 'tpu' with ``libtpu`` (or ``TPU_LIBRARY_PATH``), 'gpu' with a
    CUDA or ROCm PJRT plugin (a module of the ``jax_plugins`` namespace or a ``jax_plugins`` entry
    point, as jax discovers them). Without its plugin jax runs on the CPU beside a GPU or TPU."""
    import importlib.util
    import pkgutil
    from importlib.metadata import entry_points

    found = set()
    if environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu"):
        found.add("tpu")
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        spec = None
    names = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)] if spec and \
        spec.submodule_search_locations else []
    names += [ep.name for ep in entry_points(group="jax_plugins")]
    if any(kind in name.lower() for name in names for _, _, kind in _GPU_DEVICES):
        found.add("gpu")
    return frozenset(found)


def run_platform(environ: Mapping[str, str] = os.environ, dev: Iterable[str] | None = None,
                 plugins: Iterable[str] | None = None) -> tuple[str, str]:
    """The platform jax will run this process's computations on, decided without importing jax:
    ('cpu' | 'tpu' | 'gpu' | another ``JAX_PLATFORMS`` name, why). Pure given ``dev`` (names under
    /dev, ``vfio/<n>`` for /dev/vfio's; default ``dev_entries()``) and ``plugins`` (default
    ``jax_plugins(environ)``, looked at only when a device is found).

    As jax picks its default backend: ``JAX_PLATFORMS``'s first entry (then the deprecated
    ``JAX_PLATFORM_NAME``) wins, found devices or not; else TPU chips, else visible NVIDIA or AMD
    GPUs, each only where the jax plugin for it is installed; else the CPU."""
    for var in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME"):
        first = environ.get(var, "").split(",")[0].strip().lower()
        if first:
            return _PLATFORM_NAMES.get(first, first), f"{var}={environ[var]}"
    dev = sorted(dev_entries() if dev is None else dev, key=lambda n: [int(t) if t.isdigit() else t
                                                                      for t in re.split(r"(\d+)", n)])
    tpus = [f"/dev/{n}" for n in dev if _TPU_DEVICES.fullmatch(n)]
    gpus, hidden = [], []
    for pattern, var, _ in _GPU_DEVICES:
        found = [f"/dev/{n}" for n in dev if pattern.fullmatch(n)]
        if found and var in environ and environ[var].split(",")[0].strip() in ("", "-1"):
            hidden.append(f"{', '.join(found)} hidden by {var}={environ[var]!r}")
        else:
            gpus += found
    if tpus or gpus:
        plugins = jax_plugins(environ) if plugins is None else frozenset(plugins)
        for name, found in (("tpu", tpus), ("gpu", gpus)):
            if found and name in plugins:
                return name, ", ".join(found)
        hidden.append(f"{', '.join(tpus + gpus)} without an installed jax plugin for them")
    return "cpu", "; ".join(hidden) or "no TPU or GPU device under /dev"


def _cache_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(environ.get("TACL_CACHE_DIR") or os.path.join(base, "tacl_jax"))


def bigalloc_library(environ: Mapping[str, str] = os.environ) -> str | None:
    """Path of the compiled bigalloc shim, built once per source version (``$CC`` or ``cc``, ~0.3 s)
    into ``$TACL_CACHE_DIR`` or ``~/.cache/tacl_jax``; None where it cannot be built (no compiler,
    no writable cache). Atomic: a concurrent build (several processes of one host) never exposes a
    half-written library."""
    source = BIGALLOC_SOURCE.read_bytes()
    tag = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:12]
    out = _cache_dir(environ) / f"bigalloc-{tag}.so"
    if out.exists():
        return str(out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(tmp), str(BIGALLOC_SOURCE), "-ldl",
               "-lpthread"]
        if subprocess.run(cmd, capture_output=True, timeout=120).returncode != 0:
            return None
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        tmp.unlink(missing_ok=True)
    return str(out)


def tuned_env(environ: Mapping[str, str], libc: tuple[str, str] | None = None,
              bigalloc: Callable[[], str | None] | None = None,
              run_on: tuple[str, str] | None = None) -> dict[str, str] | None:
    """The environment to re-execute with, or None when nothing should change. Pure but for
    ``bigalloc`` (default: ``bigalloc_library``, called only when 'auto' needs it) and
    ``run_on`` (default: ``run_platform(environ)``, asked only for 'auto').

    ``libc``: ``platform.libc_ver()`` (default: this process's). The switch ``TACL_MALLOC_TUNING``:
    'auto' -> ``TUNABLES`` and the bigalloc shim first in ``LD_PRELOAD`` (the tunables alone where
    it cannot be built) when the run uses CPU devices, nothing on a TPU or GPU run (the tuning is
    for XLA:CPU's step buffers); 'glibc' -> ``TUNABLES`` only, on any platform (asked for by
    name). Nothing changes when the switch is 'off', when the process was already re-executed,
    when ``GLIBC_TUNABLES`` is set (the user's own choice wins), when an allocator is preloaded
    (``LD_PRELOAD`` names malloc), or when the C library is not glibc.
    """
    switch = environ.get(SWITCH, "auto").strip().lower()
    if switch not in ("auto", "glibc", "off"):
        raise ValueError(f"{SWITCH}={environ[SWITCH]!r}: use 'auto', 'glibc' or 'off'")
    if switch == "off" or environ.get(_MARK) or environ.get("GLIBC_TUNABLES"):
        return None
    if "malloc" in environ.get("LD_PRELOAD", ""):
        return None
    name, _ = libc if libc is not None else platform.libc_ver()
    if name != "glibc":
        return None
    if switch == "auto" and (run_on or run_platform(environ))[0] != "cpu":
        return None
    env = {**environ, "GLIBC_TUNABLES": TUNABLES, _MARK: "1"}
    if switch == "auto" and "bigalloc" not in environ.get("LD_PRELOAD", ""):   # not twice
        lib = (bigalloc or (lambda: bigalloc_library(environ)))()
        if lib:
            env["LD_PRELOAD"] = ":".join(p for p in (lib, environ.get("LD_PRELOAD", "")) if p)
        else:
            env[_MARK] = "no-bigalloc"   # for describe(): 'auto' without a working C compiler
    return env


def describe(environ: Mapping[str, str], run_on: tuple[str, str] | None = None) -> str:
    """One line for the start-up log: which allocator this process runs with, and why. ``run_on``:
    ``run_platform(environ)`` by default, decided again here (nothing records it when there was no
    re-exec; the same environment and /dev give the same answer)."""
    if environ.get(_MARK):
        if "bigalloc" in environ.get("LD_PRELOAD", ""):
            return "glibc malloc tuned + bigalloc (GLIBC_TUNABLES, LD_PRELOAD; see tacl_jax.hostenv)"
        why = ("bigalloc not built: no working C compiler `cc`" if environ[_MARK] == "no-bigalloc"
               else f"{SWITCH}=glibc")
        return f"glibc malloc tuned, without bigalloc ({why}; see tacl_jax.hostenv)"
    switch = environ.get(SWITCH, "auto").strip().lower()
    if switch == "off":
        return f"system default ({SWITCH}=off)"
    if environ.get("GLIBC_TUNABLES"):
        return f"GLIBC_TUNABLES={environ['GLIBC_TUNABLES']} (set by the caller)"
    if "malloc" in environ.get("LD_PRELOAD", ""):
        return f"preloaded {environ['LD_PRELOAD']}"
    if switch == "auto":
        name, why = run_on or run_platform(environ)
        if name != "cpu":
            return (f"system default (the run uses {name.upper()} devices: {why}; the allocator tuning is "
                    f"for XLA:CPU only, {SWITCH}=glibc forces the tunables)")
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


def bigalloc_stats() -> dict[str, int] | None:
    """The bigalloc shim's counters in this process (blocks mapped, requests served by reuse, blocks
    unmapped, waits for a block in use that timed out), or None when it is not loaded."""
    import ctypes

    try:
        fn = ctypes.CDLL(None).tacl_bigalloc_stats
    except AttributeError:
        return None
    vals = [ctypes.c_ulong() for _ in range(4)]
    fn(*[ctypes.byref(v) for v in vals])
    return dict(zip(("mapped", "reused", "unmapped", "timeouts"), (v.value for v in vals)))


def page_faults_of_reuse(nbytes: int = 256 << 20, in_thread: bool = False) -> int:
    """Minor page faults of touching a fresh ``nbytes`` malloc after an equal one was freed: ~0
    when the allocator reuses the block, ``nbytes / 4 KiB`` when it maps new memory (glibc's
    default; ``nbytes / 2 MiB`` where the new mapping gets transparent huge pages). ``in_thread``:
    measured on a new thread, as XLA allocates (glibc: a thread arena of its own, which maps a
    block this big afresh; see the module doc). Linux/glibc only; what ``python -m tacl_jax.hostenv``
    reports."""
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

    report = {"allocator": describe(os.environ), "platform": run_platform(os.environ),
              "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES"),
              "LD_PRELOAD": os.environ.get("LD_PRELOAD"), "reexecuted": bool(os.environ.get(_MARK)),
              "libc": "-".join(platform.libc_ver()), "page_faults_256mb_reuse": page_faults_of_reuse(),
              "page_faults_256mb_reuse_thread": page_faults_of_reuse(in_thread=True)}
    print(json.dumps({**report, "bigalloc": bigalloc_stats()}))
