"""The tuned allocator (tacl_jax.hostenv): the decision, and that it does what it claims — a freed
big block is reused without new page faults, on the main thread and on another — in a real
re-executed process. The bigalloc shim's own behaviour: tests/test_bigalloc.py."""

import json
import os
import platform
import subprocess
import sys

import pytest

from tacl_jax import hostenv

GLIBC = ("glibc", "2.36")
CPU = ("cpu", "no TPU or GPU device under /dev")   # these tests' run: the tuning applies (as on any host)


def test_decision_table(monkeypatch):
    # A CPU run, wherever the suite runs (a TPU VM included); the platform's own table: test_run_platform.
    monkeypatch.setattr(hostenv, "run_platform", lambda environ: CPU)
    lib = lambda: "/cache/bigalloc-0.so"
    env = hostenv.tuned_env({"PATH": "/bin"}, GLIBC, bigalloc=lib)
    assert env["GLIBC_TUNABLES"] == hostenv.TUNABLES and env["PATH"] == "/bin" and env[hostenv._MARK] == "1"
    assert env["LD_PRELOAD"] == "/cache/bigalloc-0.so"
    # ALLOCATOR_VARS names every variable it sets (the bench clears them to choose its own).
    assert set(env) - {"PATH"} <= set(hostenv.ALLOCATOR_VARS)
    # The shim goes first (it must interpose malloc); another preloaded library is kept.
    env = hostenv.tuned_env({"LD_PRELOAD": "/lib/libfoo.so"}, GLIBC, bigalloc=lib)
    assert env["LD_PRELOAD"] == "/cache/bigalloc-0.so:/lib/libfoo.so"
    again = hostenv.tuned_env({"LD_PRELOAD": env["LD_PRELOAD"]}, GLIBC, bigalloc=lib)   # not twice
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"]
    # No compiler: the tunables alone, and the log says why.
    env = hostenv.tuned_env({}, GLIBC, bigalloc=lambda: None)
    assert env["GLIBC_TUNABLES"] == hostenv.TUNABLES and "LD_PRELOAD" not in env
    assert "no working C compiler" in hostenv.describe(env)
    # 'glibc': the tunables alone, the shim not even built.
    built = []
    env = hostenv.tuned_env({hostenv.SWITCH: "glibc"}, GLIBC, bigalloc=lambda: built.append(1))
    assert env["GLIBC_TUNABLES"] == hostenv.TUNABLES and "LD_PRELOAD" not in env and not built
    # Left alone: opted out, already re-executed, the user's own tunables, a preloaded allocator, musl.
    for environ, libc in [({hostenv.SWITCH: "off"}, GLIBC), ({hostenv.SWITCH: "OFF"}, GLIBC),
                          ({hostenv._MARK: "1"}, GLIBC), ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, GLIBC),
                          ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, GLIBC), ({}, ("", ""))]:
        assert hostenv.tuned_env(environ, libc, bigalloc=lambda: built.append(1)) is None
    assert not built
    with pytest.raises(ValueError, match="TACL_MALLOC_TUNING='one_arena'.*'auto', 'glibc' or 'off'"):
        hostenv.tuned_env({hostenv.SWITCH: "one_arena"}, GLIBC)


TPU_VM = ["null", "accel0", "accel1", "accel2", "accel3", "vfio"]     # Cloud TPU v4
VFIO_TPU = ["null", "vfio", "vfio/vfio", "vfio/0", "vfio/1"]           # Cloud TPU v5e / v6e
NVIDIA = ["null", "nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"]
PLAIN = ["null", "zero", "kvm", "vfio", "vfio/vfio", "nvidiactl"]     # no chip, no GPU
BOTH = {"tpu", "gpu"}                                                  # jax plugins installed


@pytest.mark.parametrize("environ, dev, plugins, expect", [
    ({}, TPU_VM, BOTH, ("tpu", "/dev/accel0, /dev/accel1, /dev/accel2, /dev/accel3")),
    ({}, VFIO_TPU, BOTH, ("tpu", "/dev/vfio/0, /dev/vfio/1")),
    ({}, NVIDIA, BOTH, ("gpu", "/dev/nvidia0, /dev/nvidia1")),
    ({}, ["kfd", "dri"], BOTH, ("gpu", "/dev/kfd")),
    ({"CUDA_VISIBLE_DEVICES": "0"}, NVIDIA, BOTH, ("gpu", "/dev/nvidia0, /dev/nvidia1")),
    ({"CUDA_VISIBLE_DEVICES": ""}, NVIDIA, BOTH,
     ("cpu", "/dev/nvidia0, /dev/nvidia1 hidden by CUDA_VISIBLE_DEVICES=''")),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, NVIDIA, BOTH,
     ("cpu", "/dev/nvidia0, /dev/nvidia1 hidden by CUDA_VISIBLE_DEVICES='-1'")),
    ({}, NVIDIA, {"tpu"}, ("cpu", "/dev/nvidia0, /dev/nvidia1 without an installed jax plugin for them")),
    ({"JAX_PLATFORMS": "cpu"}, TPU_VM, BOTH, ("cpu", "JAX_PLATFORMS=cpu")),
    ({"JAX_PLATFORMS": "cpu,tpu"}, TPU_VM, BOTH, ("cpu", "JAX_PLATFORMS=cpu,tpu")),     # the first wins
    ({"JAX_PLATFORMS": "tpu"}, PLAIN, set(), ("tpu", "JAX_PLATFORMS=tpu")),
    ({"JAX_PLATFORMS": "cuda"}, PLAIN, set(), ("gpu", "JAX_PLATFORMS=cuda")),
    ({"JAX_PLATFORMS": ""}, TPU_VM, BOTH, ("tpu", "/dev/accel0, /dev/accel1, /dev/accel2, /dev/accel3")),
    ({"JAX_PLATFORM_NAME": "cpu"}, NVIDIA, BOTH, ("cpu", "JAX_PLATFORM_NAME=cpu")),
    ({}, PLAIN, BOTH, CPU),
])
def test_run_platform(environ, dev, plugins, expect):
    assert hostenv.run_platform(environ, dev, plugins) == expect


def test_tuned_only_on_cpu_runs():
    """'auto' re-executes only for a CPU run, and the log line says why not; 'glibc' (asked for by
    name) tunes on any platform; the shim is not even built for an accelerator run."""
    built = []
    lib = lambda: built.append(1) or "/c/bigalloc-0.so"
    for environ, dev, kind, why in [({}, TPU_VM, "TPU", "/dev/accel0, /dev/accel1, /dev/accel2, /dev/accel3"),
                                    ({}, VFIO_TPU, "TPU", "/dev/vfio/0, /dev/vfio/1"),
                                    ({}, NVIDIA, "GPU", "/dev/nvidia0, /dev/nvidia1"),
                                    ({"JAX_PLATFORMS": "tpu"}, PLAIN, "TPU", "JAX_PLATFORMS=tpu"),
                                    ({hostenv.SWITCH: "auto"}, TPU_VM, "TPU", "/dev/accel0")]:
        run_on = hostenv.run_platform(environ, dev, BOTH)
        assert hostenv.tuned_env(environ, GLIBC, bigalloc=lib, run_on=run_on) is None
        line = hostenv.describe(environ, run_on)
        assert line.startswith(f"system default (the run uses {kind} devices: {why}")
        assert "for XLA:CPU only" in line
    assert not built
    for environ, dev in [({"JAX_PLATFORMS": "cpu"}, TPU_VM), ({"CUDA_VISIBLE_DEVICES": ""}, NVIDIA), ({}, PLAIN)]:
        run_on = hostenv.run_platform(environ, dev, BOTH)
        env = hostenv.tuned_env(environ, GLIBC, bigalloc=lib, run_on=run_on)
        assert env["GLIBC_TUNABLES"] == hostenv.TUNABLES and env["LD_PRELOAD"] == "/c/bigalloc-0.so"
        assert "tuned + bigalloc" in hostenv.describe(env, run_on)
    env = hostenv.tuned_env({hostenv.SWITCH: "glibc"}, GLIBC, run_on=("tpu", "/dev/accel0"))
    assert env["GLIBC_TUNABLES"] == hostenv.TUNABLES and "LD_PRELOAD" not in env
    # The other reasons to leave the process alone come first, as before.
    off = hostenv.describe({hostenv.SWITCH: "off"}, ("tpu", "/dev/accel0"))
    assert off == "system default (TACL_MALLOC_TUNING=off)"


def test_dev_entries(tmp_path):
    for name in ("null", "accel0", "vfio/vfio", "vfio/0"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).touch()
    assert sorted(hostenv.dev_entries(str(tmp_path))) == ["accel0", "null", "vfio", "vfio/0", "vfio/vfio"]
    assert hostenv.dev_entries(str(tmp_path / "missing")) == []
    assert hostenv.run_platform({}, hostenv.dev_entries(str(tmp_path)), BOTH)[0] == "tpu"


def _report(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in hostenv.ALLOCATOR_VARS}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-m", "tacl_jax.hostenv"], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc")
def test_reexec_reuses_freed_blocks():
    tuned = _report({"JAX_PLATFORMS": "cpu"})   # the suite's platform (conftest), here spelled out
    assert tuned["platform"] == ["cpu", "JAX_PLATFORMS=cpu"]
    assert tuned["reexecuted"] and tuned["GLIBC_TUNABLES"] == hostenv.TUNABLES
    assert "bigalloc" in tuned["LD_PRELOAD"] and "+ bigalloc" in tuned["allocator"]
    glibc = _report({hostenv.SWITCH: "glibc"})
    assert glibc["reexecuted"] and glibc["LD_PRELOAD"] is None and glibc["bigalloc"] is None
    system = _report({hostenv.SWITCH: "off"})
    assert not system["reexecuted"] and system["GLIBC_TUNABLES"] is None
    pages = (256 << 20) // 4096
    # glibc's default maps a fresh 256 MiB block: every page faults again; a reused one faults not
    # at all (a fresh one at least once per 2 MiB huge page: 128).
    assert system["page_faults_256mb_reuse"] > 0.9 * pages
    assert system["page_faults_256mb_reuse_thread"] > 0.9 * pages
    # The tunables alone: reused on the main thread, but a thread's arena maps it afresh (glibc
    # falls back to mmap despite mmap_max=0: 129 faults here, 65,537 without huge pages).
    assert glibc["page_faults_256mb_reuse"] < 32
    assert glibc["page_faults_256mb_reuse_thread"] >= 100
    # With bigalloc: reused on both (the main thread's by glibc's heap, the other thread's by the
    # shim: its counters say it served that one).
    assert tuned["page_faults_256mb_reuse"] < 32 and tuned["page_faults_256mb_reuse_thread"] < 32
    assert tuned["bigalloc"]["mapped"] == 1 and tuned["bigalloc"]["reused"] == 1


def test_describe_names_the_allocator():
    assert "tuned + bigalloc" in hostenv.describe(
        hostenv.tuned_env({}, GLIBC, bigalloc=lambda: "/c/bigalloc-0.so", run_on=CPU))
    assert "without bigalloc (TACL_MALLOC_TUNING=glibc" in hostenv.describe(
        hostenv.tuned_env({hostenv.SWITCH: "glibc"}, GLIBC))
    assert "TACL_MALLOC_TUNING=off" in hostenv.describe({hostenv.SWITCH: "off"})
    assert "set by the caller" in hostenv.describe({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert hostenv.describe({}, CPU) == "system default"   # a CPU run not tuned: not glibc


@pytest.mark.slow
def test_bigalloc_library_is_built_once_and_atomically(tmp_path):
    env = {"TACL_CACHE_DIR": str(tmp_path)}
    first = hostenv.bigalloc_library(env)
    assert first and os.path.dirname(first) == str(tmp_path) and os.path.getsize(first) > 0
    mtime = os.stat(first).st_mtime_ns
    assert hostenv.bigalloc_library(env) == first and os.stat(first).st_mtime_ns == mtime   # cached
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(first)]                # no temp left
    # A compiler that fails: None (the caller falls back to the tunables), nothing left behind.
    other = tmp_path / "other"
    assert hostenv.bigalloc_library({"TACL_CACHE_DIR": str(other), "CC": "false"}) is None
    assert list(other.iterdir()) == []
