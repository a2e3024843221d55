"""The real train step compiled for Cloud TPU topologies on this CPU host (``tacl_jax.aot``): the
target decides the numerics and kernels, the hosts' batch arithmetic, what the report counts,
and a program too large for its topology exits 2. Needs libtpu (``pip install -e ".[aot]"``)."""

import json
import os
import subprocess
import sys

import pytest

from tacl_jax import aot, precision
from tacl_jax.models import layers
from tacl_jax.train import setup
from test_train import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


@pytest.fixture(autouse=True)
def _libtpu(request):
    """TPU compiles need libtpu (the ``aot`` extra): skipped without it, except under CI (``CI``
    set), where .ci/run installs it and its absence is an install bug."""
    from tacl_jax import topology

    if "gpu" not in request.node.name and not topology._libtpu_available():
        if os.environ.get("CI"):
            pytest.fail('libtpu is missing under CI: .ci/run must pip install -e ".[aot]"')
        pytest.skip('libtpu not installed (pip install -e ".[aot]")')


def _tiny(**overrides):
    return tiny_config(**overrides)   # configs/tiny.py with dotted-key overrides (tests/test_train.py)


@pytest.mark.slow
def test_multihost_tpu_program_is_decided_by_the_target():
    """v5e-16 (16 chips, 4 hosts): 'auto' is bf16 though this host's CPU may say f32, the kernels
    are plain XLA (no CPU-only op in the program), every host feeds B/4 rows, the traced matmul
    FLOPs equal ``tacl_jax.flops``, and XLA's FLOPs are counted (loops × trip counts)."""
    c = _tiny(**{"model.dtype": "auto", "global_batch_size": 32, "grad_accum_steps": 2})
    r = aot.compile_report(c, "v5e-16", "tiny")
    assert (r["devices"], r["hosts"], r["platform"]) == (16, 4, "tpu")
    assert r["compute_dtype"] == "bfloat16" and r["kernels"] == "xla"
    assert not r["cpu_kernels_in_program"] and r["cpu_kernel_ops"] == 0
    assert r["rows_per_host"] == {"0": 8, "1": 8, "2": 8, "3": 8}
    assert abs(r["matmul_flops_ratio"] - 1.0) < 0.05, r["matmul_flops_ratio"]
    # XLA's count adds element-wise work (large next to a 32-wide model's matmuls): above the
    # matmuls, never below them once the accumulation loop's second trip is counted.
    assert r["flops_ratio"] >= r["matmul_flops_ratio"] * 0.99
    assert any(loop["trip_count"] == 2 for loop in r["loops"]), r["loops"]   # grad_accum_steps=2
    assert r["fits"] and 0 < r["hbm_fraction"] < 0.01 and r["estimated_step_s"] > 0
    assert r["collective_bytes"] > 0   # data parallel: the gradients are all-reduced


def test_host_rows_follow_the_topology():
    """Each of v5e-16's 4 hosts holds a quarter of the batch (not contiguous: the mesh follows
    the torus, and ``make_array_from_process_local_data`` maps a host's rows to its devices'
    slices in order), the quarters partition it, and the batch arithmetic is checked against the
    topology's data-parallel devices and hosts, not this process's count of 1."""
    from tacl_jax import parallel, topology

    devices = topology.compile_only_devices("v5e-16")
    mesh = parallel.make_mesh(dict(data=-1, fsdp=1, tensor=1), devices)
    rows = setup.host_rows(mesh, 64)
    assert sorted(rows) == [0, 1, 2, 3]
    assert sorted(r for rs in rows.values() for r in rs) == list(range(64))
    assert all(len(r) == 16 for r in rows.values())
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 16"):
        setup.check_batch_arithmetic(_tiny(global_batch_size=8), mesh)
    with pytest.raises(ValueError, match="micro-batch of 24"):
        setup.check_batch_arithmetic(_tiny(global_batch_size=48, grad_accum_steps=2), mesh)


@pytest.mark.slow
def test_cpu_kernels_are_detected_in_a_program(monkeypatch):
    """The detector is real: forcing the XLA:CPU kernel family into a v4-8 program (bf16, with the
    transposed copies) shows up as CPU-only ops; the same program for the CPU has them too."""
    monkeypatch.setattr(precision, "kernels_for", lambda platform: "cpu")
    monkeypatch.setattr(layers, "CPU_BF16_TRANSPOSED_COPY", True)
    r = aot.compile_report(_tiny(**{"model.dtype": "bfloat16"}), "v4-8", "tiny")
    assert r["kernels"] == "cpu" and r["cpu_kernels_in_program"] and r["cpu_kernel_ops"] > 0


@pytest.mark.slow
def test_too_large_for_the_topology_exits_2(tmp_path):
    """A 4M-word vocabulary at hidden 1024 (16 GB of word embeddings, plus Adam's moments and the
    teacher) cannot fit a v4 chip: exit status 2, a message naming the config and the bytes."""
    out = tmp_path / "r.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "tacl_jax.aot", f"--config={TINY}", "--topology=v4-8", f"--json={out}",
         "--config.init.scratch.vocab_size=4000000", "--config.init.scratch.hidden_size=1024",
         "--config.init.scratch.num_attention_heads=8"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == aot.EXIT_DOES_NOT_FIT, proc.stderr[-3000:]
    assert "does not fit v4-8" in proc.stderr and "tiny.py" in proc.stderr
    assert any(ch.isdigit() for ch in proc.stderr.split("does not fit", 1)[1])
    report = json.loads(out.read_text())
    assert report["fits"] is False


@pytest.mark.slow
def test_gpu_program_compiles_where_the_cuda_plugin_is():
    """8×H100 (``launch/aot_gpu_env.sh`` makes the environment; libtpu must not share it)."""
    import importlib.util

    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("the CUDA PJRT plugin is not installed here: GPU compiles run in the separate "
                    "environment of launch/aot_gpu_env.sh")
    r = aot.compile_report(_tiny(**{"model.dtype": "auto"}), "h100x8", "tiny")
    assert r["platform"] == "gpu" and r["compute_dtype"] == "bfloat16" and not r["cpu_kernels_in_program"]
    assert r["fits"]


@pytest.mark.slow
def test_the_loop_runs_the_builders_program(tmp_path, monkeypatch):
    """``train_and_evaluate`` trains with the step ``build_program`` jitted (the one ``tacl_jax.aot``
    compiles), on this process's devices: every training step goes through it, and its program
    was decided for the CPU (kernels 'cpu', 'auto' resolved from this host)."""
    from tacl_jax.train import loop

    built, calls = [], []

    def spy(config, devices):
        prog = setup.build_program(config, devices)
        step = prog.train_step
        prog.train_step = lambda *a: calls.append(1) or step(*a)
        built.append(prog)
        return prog

    monkeypatch.setattr(loop, "build_program", spy)
    c = _tiny(num_train_steps=3, eval_at_end=False, export_at_end=False, **{"analysis.enabled": False})
    assert loop.train_and_evaluate(c, str(tmp_path))["status"] == "finished"
    assert len(built) == 1 and len(calls) == 3
    prog = built[0]
    assert prog.target.platform == "cpu" and prog.model.config.kernels == "cpu"
    assert prog.model.config.dtype == precision.resolve_compute_dtype(c.model.dtype, "cpu")


@pytest.mark.slow
def test_a_larger_teacher_compiles_for_a_v4_8_and_is_counted(tmp_path):
    """A tiny student (32 wide) with a teacher of its own (48 wide, 3 layers) compiles for a v4-8:
    the report names the teacher, the traced matmuls equal ``tacl_jax.flops`` (teacher and
    projection counted), and it fits. An uncached Hub id as the teacher is refused with the fix."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from tacl_jax import hf
    from tacl_jax.errors import ConfigError
    from tacl_jax.models import BertConfig, BertModel

    cfg = BertConfig(vocab_size=512, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=64)
    model = BertModel(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    hf.save(model, params, str(tmp_path / "teacher"), head="none")
    c = _tiny(**{"model.dtype": "auto", "global_batch_size": 16, "tacl.teacher_hf_path": str(tmp_path / "teacher")})
    r = aot.compile_report(c, "v4-8", "tiny")
    assert r["teacher"].endswith("3 layers, hidden 48")
    assert abs(r["matmul_flops_ratio"] - 1.0) < 0.05, r["matmul_flops_ratio"]
    assert r["fits"] and "teacher:" in aot.format_report(r)
    with pytest.raises(ConfigError, match="is not on this machine.*hf download org/not-cached-bert"):
        aot.compile_report(_tiny(**{"tacl.teacher_hf_path": "org/not-cached-bert"}), "v4-8", "tiny")
