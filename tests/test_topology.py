"""tacl_jax.topology: the compile-only devices of each table entry, and the table's HBM figures.

TPU tests need libtpu (the ``aot`` extra, installed by .ci/run): without it they are skipped,
except under CI (``CI`` set), where a missing libtpu is an install bug and fails. The GPU test
needs the CUDA PJRT plugin, which lives in its own environment (launch/aot_gpu_env.sh): skipped
elsewhere, with the reason.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tacl_jax import topology as topo_lib
from tacl_jax.topology import TOPOLOGIES, compile_only_devices

TPU_NAMES = [n for n, t in TOPOLOGIES.items() if t.platform == "tpu"]
GPU_NAMES = [n for n, t in TOPOLOGIES.items() if t.platform == "gpu"]


def _need_libtpu():
    if not topo_lib._libtpu_available():
        if os.environ.get("CI"):
            pytest.fail('libtpu is missing under CI: .ci/run must pip install -e ".[aot]"')
        pytest.skip('libtpu not installed (pip install -e ".[aot]")')


def _need_cuda_plugin():
    if not topo_lib._cuda_plugin_importable():
        pytest.skip("the CUDA PJRT plugin is not importable here: its tests run in the separate "
                    "environment of launch/aot_gpu_env.sh")
    if topo_lib._plugin_loaded("tpu"):
        pytest.skip("libtpu is loaded in this process (a TPU test ran first): the GPU topology "
                    "is compiled in a process without it")


def _full_output(devices, nbytes_per_device: int):
    """A one-device program whose only buffers are a float32 output of ``nbytes_per_device``."""
    sharding = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), P())
    rows = nbytes_per_device // (4 * 1024)
    f = jax.jit(lambda x: jnp.broadcast_to(x, (rows, 1024)) + 1.0, out_shardings=sharding)
    return f.lower(jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharding))


def test_table_is_consistent():
    for name, t in TOPOLOGIES.items():
        assert t.name == name and t.platform in ("tpu", "gpu")
        assert 0 < t.usable_hbm_bytes <= t.hbm_bytes
        assert t.num_devices % t.num_hosts == 0 and t.peak_flops > 0 and t.clock_hz > 0
        assert t.topology_args["platform"] == {"tpu": "tpu", "gpu": "cuda"}[t.platform]
        with pytest.raises(TypeError):  # the shared table's kwargs are read-only
            t.topology_args["platform"] = "cpu"
    # The GPU target description ships with the package and describes the table's device.
    for name in GPU_NAMES:
        text = (topo_lib.TARGETS_DIR / TOPOLOGIES[name].target_file).read_text()
        assert f'device_description_str: "{TOPOLOGIES[name].device_kind}"' in text


@pytest.mark.parametrize("name", TPU_NAMES)
def test_tpu_devices_match_table(name):
    _need_libtpu()
    t = TOPOLOGIES[name]
    devices = compile_only_devices(name)
    assert len(devices) == t.num_devices
    assert len({d.process_index for d in devices}) == t.num_hosts
    assert {d.device_kind for d in devices} == {t.device_kind}
    assert {d.platform for d in devices} == {"tpu"}
    # Cached: the same device objects again, so meshes made from two calls agree.
    assert compile_only_devices(name) == devices


@pytest.mark.parametrize("name", TPU_NAMES)
def test_tpu_usable_hbm(name):
    """The table's usable HBM is the compiler's limit: 1 MiB below it fits (the program's code
    and argument take ~60 KiB), 4 KiB above it is RESOURCE_EXHAUSTED."""
    _need_libtpu()
    usable = TOPOLOGIES[name].usable_hbm_bytes
    devices = compile_only_devices(name)
    _full_output(devices, usable - (1 << 20)).compile()
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        _full_output(devices, usable + 4096).compile()


def test_v4_8_matmul_compiles():
    _need_libtpu()
    devices = compile_only_devices("v4-8")
    mesh = Mesh(np.array(devices), ("data",))
    rows = NamedSharding(mesh, P("data", None))
    x_bsd = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=rows)
    w_df = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda x, w: x @ w, out_shardings=rows).lower(x_bsd, w_df).compile()
    mem = compiled.memory_analysis()
    # Per device: a quarter of x (256×512 bf16) plus all of w (512×256 bf16); a quarter of the output.
    assert mem.argument_size_in_bytes == 256 * 512 * 2 + 512 * 256 * 2
    assert mem.output_size_in_bytes == 256 * 256 * 2
    # Compiling for the topology leaves the host's own backend alone.
    assert jax.devices()[0].platform == "cpu"


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown topology 'v9-1'; known: .*v4-8.*h100x8"):
        compile_only_devices("v9-1")


def test_missing_plugin_errors(monkeypatch):
    monkeypatch.setattr(topo_lib, "_libtpu_available", lambda: False)
    with pytest.raises(RuntimeError, match=r'pip install -e "\.\[aot\]"'):
        topo_lib._tpu_devices(TOPOLOGIES["v4-8"])
    for name in GPU_NAMES:
        monkeypatch.setattr(topo_lib, "_cuda_plugin_importable", lambda: False)
        with pytest.raises(RuntimeError, match="launch/aot_gpu_env.sh"):
            topo_lib._gpu_devices(TOPOLOGIES[name])
        monkeypatch.setattr(topo_lib, "_cuda_plugin_importable", lambda: True)
        monkeypatch.setattr(topo_lib, "_plugin_loaded", lambda platform: platform == "tpu")
        with pytest.raises(RuntimeError, match="libtpu is loaded in this process"):
            topo_lib._gpu_devices(TOPOLOGIES[name])


def test_env_defaults_are_temporary(monkeypatch):
    monkeypatch.delenv("TACL_TEST_UNSET", raising=False)
    monkeypatch.setenv("TACL_TEST_SET", "mine")
    with topo_lib._env_defaults({"TACL_TEST_UNSET": "a", "TACL_TEST_SET": "b"}):
        assert os.environ["TACL_TEST_UNSET"] == "a" and os.environ["TACL_TEST_SET"] == "mine"
    assert "TACL_TEST_UNSET" not in os.environ and os.environ["TACL_TEST_SET"] == "mine"


@pytest.mark.parametrize("name", GPU_NAMES)
def test_gpu_devices_and_compile(name):
    _need_cuda_plugin()
    t = TOPOLOGIES[name]
    devices = compile_only_devices(name)
    assert len(devices) == t.num_devices
    assert len({d.process_index for d in devices}) == t.num_hosts
    assert {d.device_kind for d in devices} == {t.device_kind}
    assert {d.platform for d in devices} == {"gpu"}
    mesh = Mesh(np.array(devices), ("data",))
    rows = NamedSharding(mesh, P("data", None))
    x_bsd = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=rows)
    w_df = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda x, w: x @ w, out_shardings=rows).lower(x_bsd, w_df).compile()
    assert compiled.memory_analysis().output_size_in_bytes == 1024 // t.num_devices * 256 * 2
