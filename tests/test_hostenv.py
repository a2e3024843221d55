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


def test_decision_table():
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


def _report(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in hostenv.ALLOCATOR_VARS}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-m", "tacl_jax.hostenv"], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc")
def test_reexec_reuses_freed_blocks():
    tuned = _report({})
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
    assert "tuned + bigalloc" in hostenv.describe(hostenv.tuned_env({}, GLIBC, bigalloc=lambda: "/c/bigalloc-0.so"))
    assert "without bigalloc (TACL_MALLOC_TUNING=glibc" in hostenv.describe(
        hostenv.tuned_env({hostenv.SWITCH: "glibc"}, GLIBC))
    assert "TACL_MALLOC_TUNING=off" in hostenv.describe({hostenv.SWITCH: "off"})
    assert "set by the caller" in hostenv.describe({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert hostenv.describe({}) == "system default"


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
