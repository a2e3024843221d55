"""The tuned glibc allocator (tacl_jax.hostenv): the decision, and that it does what it claims —
a freed big block is reused without new page faults — in a real re-executed process."""

import json
import os
import platform
import subprocess
import sys

import pytest

from tacl_jax import hostenv

GLIBC = ("glibc", "2.36")


def test_decision_table():
    env = hostenv.tuned_env({"PATH": "/bin"}, GLIBC)
    assert env["GLIBC_TUNABLES"] == hostenv.TUNABLES and env["PATH"] == "/bin" and env[hostenv._MARK] == "1"
    # Left alone: opted out, already re-executed, the user's own tunables, a preloaded allocator, musl.
    assert hostenv.tuned_env({hostenv.SWITCH: "off"}, GLIBC) is None
    assert hostenv.tuned_env({hostenv.SWITCH: "OFF"}, GLIBC) is None
    assert hostenv.tuned_env({hostenv._MARK: "1"}, GLIBC) is None
    assert hostenv.tuned_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, GLIBC) is None
    assert hostenv.tuned_env({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, GLIBC) is None
    assert hostenv.tuned_env({}, ("", "")) is None
    one = hostenv.tuned_env({hostenv.SWITCH: "one_arena"}, GLIBC)
    assert one["GLIBC_TUNABLES"] == hostenv.TUNABLES + ":glibc.malloc.arena_max=1"
    with pytest.raises(ValueError, match="TACL_MALLOC_TUNING='yes'.*'auto', 'one_arena' or 'off'"):
        hostenv.tuned_env({hostenv.SWITCH: "yes"}, GLIBC)


def _report(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hostenv._MARK, hostenv.SWITCH)}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-m", "tacl_jax.hostenv"], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc tunables")
def test_reexec_reuses_freed_blocks():
    tuned = _report({})
    assert tuned["reexecuted"] and tuned["GLIBC_TUNABLES"] == hostenv.TUNABLES
    system = _report({hostenv.SWITCH: "off"})
    assert not system["reexecuted"] and system["GLIBC_TUNABLES"] is None
    pages = (256 << 20) // 4096
    # glibc's default maps a fresh 256 MiB block: every page faults again; tuned: reused. A fresh
    # block faults at least once per 2 MiB huge page (128 here), a reused one not at all.
    assert system["page_faults_256mb_reuse"] > 0.9 * pages
    assert system["page_faults_256mb_reuse_thread"] > 0.9 * pages
    assert tuned["page_faults_256mb_reuse"] < 32
    # On a thread of its own, as XLA allocates, the default still maps the block afresh (glibc's
    # thread arenas fall back to mmap despite mmap_max=0: 129 faults here); one arena reuses it.
    one = _report({hostenv.SWITCH: "one_arena"})
    assert one["reexecuted"] and one["GLIBC_TUNABLES"].endswith(":glibc.malloc.arena_max=1")
    assert one["page_faults_256mb_reuse"] < 32 and one["page_faults_256mb_reuse_thread"] < 32


def test_describe_names_the_allocator():
    assert "tuned (" in hostenv.describe(hostenv.tuned_env({}, GLIBC))
    assert "tuned, one arena" in hostenv.describe(hostenv.tuned_env({hostenv.SWITCH: "one_arena"}, GLIBC))
    assert "TACL_MALLOC_TUNING=off" in hostenv.describe({hostenv.SWITCH: "off"})
    assert "set by the caller" in hostenv.describe({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert hostenv.describe({}) == "system default"
