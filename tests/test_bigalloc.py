"""The bigalloc shim (tacl_jax/bigalloc.c, preloaded by tacl_jax.hostenv): each behaviour its module
doc claims, checked in a real process that preloads it, through ctypes, and XLA running under it."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from tacl_jax import hostenv

pytestmark = [pytest.mark.slow,  # every test runs a Python process under the shim
              pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                 reason="an LD_PRELOAD shim over glibc malloc")]
MB = 1 << 20

# Runs under the shim; prints one JSON line. `stats()` reads the shim's counters.
PRELUDE = textwrap.dedent("""
    import ctypes, json, threading, time
    libc = ctypes.CDLL(None)
    for name, res, args in [("malloc", ctypes.c_void_p, [ctypes.c_size_t]), ("free", None, [ctypes.c_void_p]),
                            ("calloc", ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]),
                            ("realloc", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]),
                            ("malloc_usable_size", ctypes.c_size_t, [ctypes.c_void_p]),
                            ("posix_memalign", ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t])]:
        fn = getattr(libc, name); fn.restype = res; fn.argtypes = args
    MB = 1 << 20
    from tacl_jax.hostenv import bigalloc_stats as stats
    def on_thread(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(fn())); t.start(); t.join()
        return out[0]
""")


@pytest.fixture(scope="module")
def library():
    lib = hostenv.bigalloc_library()
    assert lib, "the bigalloc shim did not build: is a C compiler (`cc`) installed?"
    return lib


def _run(library, body, main_thread=False, **env):
    """Runs ``body`` under the shim on a thread other than the main one (whose big blocks are
    glibc's), as XLA allocates."""
    full = {**os.environ, "LD_PRELOAD": library, **{k: str(v) for k, v in env.items()}}
    full.pop("GLIBC_TUNABLES", None)
    body = textwrap.dedent(body)
    code = PRELUDE + (body if main_thread else
                      f"_body = threading.Thread(target=exec, args=({body!r}, globals()))\n_body.start(); _body.join()\n")
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_block_is_reused_across_threads_zeroed_by_calloc(library):
    r = _run(library, """
        a = on_thread(lambda: libc.malloc(200 * MB))
        ctypes.memset(a, 7, 200 * MB); libc.free(a)
        b = on_thread(lambda: libc.malloc(190 * MB))          # fits (at most a quarter larger): reused
        libc.free(b)
        c = libc.calloc(50, 4 * MB)                            # reused again, must read as zeros
        small = libc.malloc(1000); libc.free(small)            # glibc's
        counts = stats()                                       # before Python's own 200 MB copy below
        zeros = ctypes.string_at(c, 200 * MB).count(0) == 200 * MB
        print(json.dumps(dict(same=a == b == c, page_aligned=a % 4096 == 0, zeros=zeros,
                              usable=libc.malloc_usable_size(c), **counts)))
    """)
    assert r["same"] and r["page_aligned"] and r["zeros"]
    assert r["usable"] == 200 * MB   # whole 2 MiB grains
    assert (r["mapped"], r["reused"], r["unmapped"]) == (1, 2, 0)


def test_the_main_threads_blocks_stay_with_glibc(library):
    r = _run(library, """
        a = libc.malloc(200 * MB); libc.free(a)       # main thread: glibc's (its heap reuses them)
        main = stats()
        b = on_thread(lambda: libc.malloc(200 * MB))
        print(json.dumps(dict(main=main, **stats())))
    """, main_thread=True)
    assert r["main"]["mapped"] == 0 and r["mapped"] == 1


def test_a_request_nothing_fits_unmaps_the_free_blocks(library):
    r = _run(library, """
        a = libc.malloc(100 * MB); libc.free(a)
        b = libc.malloc(300 * MB)       # 100 MB is too small, 300 -> 100 would waste: a new working set
        libc.free(b)
        c = libc.malloc(100 * MB)       # 300 MB would waste more than a quarter: mapped anew
        print(json.dumps(dict(b_new=b != a, **stats())))
    """)
    assert r["b_new"] and (r["mapped"], r["reused"], r["unmapped"]) == (3, 0, 2)


def test_next_step_waits_for_the_block_in_use(library):
    # XLA mallocs the next step's buffer at about the instant it frees the last one: the request
    # waits for the block in use instead of mapping a second one.
    r = _run(library, """
        a = libc.malloc(128 * MB)
        t = threading.Timer(0.05, lambda: libc.free(a)); t.start()
        start = time.perf_counter(); b = libc.malloc(128 * MB); waited = time.perf_counter() - start
        t.join(); libc.free(b)
        print(json.dumps(dict(same=a == b, waited=waited, **stats())))
    """, TACL_BIGALLOC_WAIT_US=2_000_000)
    assert r["same"] and r["waited"] > 0.03 and (r["mapped"], r["reused"], r["timeouts"]) == (1, 1, 0)
    # A wait too short: a second block is mapped; when the first comes free while the second is in
    # use it is unmapped (two would stay resident), so the next request gets the second one.
    r = _run(library, """
        a = libc.malloc(128 * MB); b = libc.malloc(128 * MB)
        libc.free(a); libc.free(b); c = libc.malloc(128 * MB)
        print(json.dumps(dict(new=a != b, same=b == c, **stats())))
    """, TACL_BIGALLOC_WAIT_US=1)
    assert r["new"] and r["same"] and (r["mapped"], r["unmapped"], r["timeouts"]) == (2, 1, 1)


def test_long_lived_blocks_stop_the_waiting_and_are_cached(library):
    # Several arrays of one size alive at once: a request waits at most twice for that size, then
    # maps at once; a freed block of that size is cached although others are in use.
    r = _run(library, """
        held = [libc.malloc(80 * MB) for _ in range(4)]      # 1 mapped, then 2 timeouts, then none
        after_requests = stats()
        libc.free(held[1])
        again = libc.malloc(80 * MB)
        print(json.dumps(dict(after_requests=after_requests, reused_freed=again == held[1], **stats())))
    """, TACL_BIGALLOC_WAIT_US=2000)
    assert {k: r["after_requests"][k] for k in ("mapped", "timeouts")} == dict(mapped=4, timeouts=2)
    assert r["reused_freed"] and (r["unmapped"], r["reused"]) == (0, 1)


def test_cache_limit_realloc_and_alignment(library):
    r = _run(library, """
        a = libc.malloc(64 * MB); b = libc.malloc(64 * MB)
        ctypes.memset(a, 3, 64 * MB)
        a2 = libc.realloc(a, 96 * MB)                      # grows: a new block, contents kept
        kept = (ctypes.c_char * (64 * MB)).from_address(a2)[:: 4096] == b"\\x03" * (16 * 1024)
        libc.free(a2); libc.free(b)                        # 96 + 64 MB free > the 100 MB cache
        after_free = stats()
        g = libc.malloc(1 * MB); ctypes.memset(g, 5, MB)
        g2 = libc.realloc(g, 80 * MB)                      # a glibc block grown into a big one
        moved = ctypes.string_at(g2, MB).count(5) == MB
        p = ctypes.c_void_p()
        rc_page = libc.posix_memalign(ctypes.byref(p), 64, 70 * MB); page = p.value
        rc_big = libc.posix_memalign(ctypes.byref(p), 1 << 16, 70 * MB); big_align = p.value
        rc_bad = libc.posix_memalign(ctypes.byref(p), 24, 70 * MB)
        print(json.dumps(dict(kept=kept, moved=moved, after_free=after_free, rc=[rc_page, rc_big, rc_bad],
                              page=page % 4096, big_align=big_align % (1 << 16), **stats())))
    """, TACL_BIGALLOC_CACHE_MB=100)
    assert r["kept"] and r["moved"]
    # a, b, a2 mapped; realloc frees a while b (same size) is in use: unmapped; then a2 and b free
    # make 160 MB > the 100 MB cache: the least recently freed (a2) is unmapped, b stays.
    assert {k: r["after_free"][k] for k in ("mapped", "reused", "unmapped")} == dict(mapped=3, reused=0, unmapped=2)
    assert r["rc"] == [0, 0, 22] and r["page"] == 0 and r["big_align"] == 0   # 22 = EINVAL


def test_xla_runs_under_it_and_reuses_its_buffers(library):
    # A jitted function whose buffers (16 MB) exceed the lowered threshold, run 10 times: results as
    # numpy computes them, and after the first few calls XLA's buffers all come from the cache.
    r = _run(library, """
        import numpy as np, jax, jax.numpy as jnp
        x = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
        want = np.tanh(x @ x.T + 1.0) @ x
        f = jax.jit(lambda a: jnp.tanh(a @ a.T + 1.0) @ a)
        errs, history = [], []
        for _ in range(10):
            errs.append(float(np.abs(np.asarray(f(x)) - want).max()))
            history.append(stats())
        print(json.dumps(dict(err=max(errs), third=history[2], last=history[-1])))
    """, TACL_BIGALLOC_MIN_MB=2, JAX_PLATFORMS="cpu")
    assert r["err"] < 1e-2
    # The last 7 calls: >= 2 buffers a call from the cache, at most 2 mapped (measured: 28 and 0-1).
    assert r["last"]["reused"] - r["third"]["reused"] >= 14
    assert r["last"]["mapped"] - r["third"]["mapped"] <= 2
    assert r["last"]["timeouts"] <= 4
