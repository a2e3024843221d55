"""The accelerator topologies we compile for ahead of time, and their compile-only devices.

Why. The train step can be lowered and compiled for a Cloud TPU slice or an 8×H100 host on a
CPU-only machine (deviceless AOT): XLA then reports the step's memory per device, its FLOPs and its
collectives before any accelerator is rented. This module is the table of those targets (device
counts, hosts, HBM, peak FLOP/s, clock) and the one place that knows how to make their
compile-only devices; ``tacl_jax.aot`` builds meshes and compiles on top of it. No training logic.

How the devices are made (``jax.experimental.topologies.get_topology_desc``):

* TPU: through ``libtpu`` (``pip install -e ".[aot]"``), no TPU needed; works with
  ``JAX_PLATFORMS=cpu`` (the test suite's setting) because the topology goes through the TPU PJRT
  plugin directly, not through JAX's backends. The first call loads and initialises libtpu for
  the whole process (0.1-0.3 s on 2 cores, ~1.5 s beside another compile); later topologies, of
  any TPU generation, take ~2 ms. Topologies can be made any number of times in one process, but
  each time as new device objects, unequal to the last: ``compile_only_devices`` caches them.
  libtpu's process-wide settings are environment variables read at that first call
  (``_tpu_devices`` sets what a CPU-only machine needs for the call's duration).
* GPU: through the CUDA PJRT plugin (``jax-cuda12-plugin`` + ``jax-cuda12-pjrt``, no CUDA
  libraries, no driver) and an XLA GPU target description shipped in ``tacl_jax/targets``. Made
  in a separate environment (``launch/aot_gpu_env.sh``; ``.[aot-gpu]``): the CUDA plugin and
  libtpu are two builds of XLA, and we keep them out of one process (see ``compile_only_devices``).

What the devices are not: ``jax.devices()`` stays the host CPU, ``jax.process_count()`` stays 1 and
``jax.default_backend()`` stays ``'cpu'`` while compiling for them; the hosts of a topology are
its devices' distinct ``process_index`` values. Nothing eager may run on them (no
``jax.random.key``, no ``device_put``): inputs are ``jax.ShapeDtypeStruct`` with a sharding.

``usable_hbm_bytes`` (TPU) was measured with libtpu 0.0.42.1 (jax 0.10.2): on one device of each
topology we compiled ``broadcast_to(x, (rows, 1024)) + 1`` in float32 and bisected ``rows`` to the
largest program that compiles (4 KiB steps); the figure is that program's argument + output +
generated-code bytes from ``memory_analysis()``. One 4 KiB step more fails with
``RESOURCE_EXHAUSTED: ... Used 30.75G of 30.75G hbm`` (v4), and the message's breakdown shows what
the rest of the chip holds: ``reserved 1.25G`` on v4, 258 MiB on v5e, 263 MiB on v5p, 260 MiB on
v6e (whose compiler capacity is 31.5 GiB, not the nominal 32). The same limit applies to HLO
temporaries ("the total memory required for HLO temporaries (200.00G) exceeds available HBM
(30.75G)"); it is per device, the same in v4-8 and v4-32.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
import pathlib
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30

# The XLA GPU target descriptions shipped with the package (package_data in setup.py).
TARGETS_DIR = pathlib.Path(__file__).parent / "targets"


@dataclass(frozen=True)
class Topology:
    """One compile target. Per-device figures are per *JAX device*: a v4/v5p chip in megacore mode
    (its two TensorCores as one device, as a Cloud TPU VM runs it), a v5e/v6e chip, one GPU."""

    name: str                  # our key, e.g. 'v4-8'
    platform: str              # 'tpu' | 'gpu': what the compile-only devices' .platform says
    accelerator_type: str      # the Cloud name: 'v4-8', 'v5litepod-16', 'v5p-8'; '8xH100-SXM'
    num_devices: int           # JAX devices in the whole topology
    num_hosts: int             # processes (VMs) it runs as: distinct device process_index values
    device_kind: str           # jax.Device.device_kind on the real hardware
    hbm_bytes: int             # nominal HBM per device
    usable_hbm_bytes: int      # what XLA can allocate per device (arguments + outputs + temps + code)
    peak_flops: float          # dense bf16 FLOP/s per device, vendor spec sheet
    clock_hz: float            # to turn XLA's estimated_cycles into seconds
    # The kwargs of jax.experimental.topologies.get_topology_desc (platform included). Read-only.
    topology_args: Mapping[str, Any] = field(hash=False)
    note: str = ""
    # GPU: the file in TARGETS_DIR whose text is passed as get_topology_desc's target_config.
    target_file: str = ""

    def __post_init__(self):
        # Frozen means frozen: nobody edits the shared table's kwargs in place.
        object.__setattr__(self, "topology_args", types.MappingProxyType(dict(self.topology_args)))

    @property
    def devices_per_host(self) -> int:
        return self.num_devices // self.num_hosts


def _tpu_args(topology_name: str, chip_config_name: str, chips_per_host_bounds: tuple[int, ...]):
    # One slice, no wraparound links: a single Cloud TPU slice of this size as a VM sees it.
    return dict(topology_name=topology_name, platform="tpu", chip_config_name=chip_config_name,
                chips_per_host_bounds=chips_per_host_bounds, num_slices=1, wrap=(False, False, False))


# H100 SXM 80GB: "80 GB" is 5 HBM3 stacks of 16 GiB; the device reports less as its total
# (cudaMemGetInfo; XLA's target description says device_memory_size 84942979072 B = 79.1 GiB).
_H100_DEVICE_MEMORY_BYTES = 84_942_979_072
# The GPU compiler raises no RESOURCE_EXHAUSTED (a 200 GiB output compiles; it only logs that the
# scheduler's base limit, 80% of device memory = 67954383257 B, is exceeded), so the limit is the
# runtime's: JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of the device's memory for XLA, 0.75 by
# default and 0.90 in our launchers (launch/gpu_single_host.sh, launch/slurm_gpu.sbatch). 10% of
# 79.1 GiB (7.9 GiB) is left to CUDA's context, cuBLAS/cuDNN workspaces and NCCL's buffers.
_GPU_MEM_FRACTION = 0.90

# Clocks. XLA:TPU's cost model, on a bf16 16384³ matmul, does ≤ 262144 FLOPs/cycle on v4 and
# v5p (245.6k, 246.0k), ≤ 131072 on v5e (120.9k) and more than 262144 on v6e (408.7k): the MXU
# widths below, and with them peak = FLOPs/cycle × clock gives the clocks (public for v4/v5e/v5p).
TOPOLOGIES: dict[str, Topology] = {t.name: t for t in [
    Topology(
        name="v4-8", platform="tpu", accelerator_type="v4-8", num_devices=4, num_hosts=1,
        device_kind="TPU v4", hbm_bytes=32 * GiB, usable_hbm_bytes=33_014_404_608,  # 30.747 GiB
        # 2 TensorCores × 4 MXUs × 128² × 2 FLOPs = 262144 FLOPs/cycle × 1.05 GHz = 275e12.
        peak_flops=275e12, clock_hz=1.05e9,
        topology_args=_tpu_args("v4:2x2x1", "megacore", (2, 2, 1)),
        note="one v4 VM, 4 chips in megacore mode (plain 'v4:2x2x1' would give 8 16-GiB TensorCores)"),
    Topology(
        name="v4-32", platform="tpu", accelerator_type="v4-32", num_devices=16, num_hosts=4,
        device_kind="TPU v4", hbm_bytes=32 * GiB, usable_hbm_bytes=33_014_404_608,
        peak_flops=275e12, clock_hz=1.05e9,
        topology_args=_tpu_args("v4:2x2x4", "megacore", (2, 2, 1)),
        note="4 v4 VMs of 4 megacore chips each, a 2x2x4 slice"),
    Topology(
        name="v5e-8", platform="tpu", accelerator_type="v5litepod-8", num_devices=8, num_hosts=1,
        device_kind="TPU v5 lite", hbm_bytes=16 * GiB, usable_hbm_bytes=16_909_328_384,  # 15.748 GiB
        # 4 MXUs × 128² × 2 FLOPs = 131072 FLOPs/cycle × 1.5 GHz = 197e12.
        peak_flops=197e12, clock_hz=1.5e9,
        topology_args=_tpu_args("v5e:2x4", "default", (2, 4, 1)),
        note="one v5e VM with 8 chips (2x4)"),
    Topology(
        name="v5e-16", platform="tpu", accelerator_type="v5litepod-16", num_devices=16, num_hosts=4,
        device_kind="TPU v5 lite", hbm_bytes=16 * GiB, usable_hbm_bytes=16_909_328_384,
        peak_flops=197e12, clock_hz=1.5e9,
        topology_args=_tpu_args("v5e:4x4", "default", (2, 2, 1)),
        note="4 v5e VMs of 4 chips each, a 4x4 slice"),
    Topology(
        name="v5p-8", platform="tpu", accelerator_type="v5p-8", num_devices=4, num_hosts=1,
        # Cloud's docs say "95 GB", but the compiler allows 95.74 GiB plus 263 MiB reserved: 96 GiB.
        device_kind="TPU v5", hbm_bytes=96 * GiB, usable_hbm_bytes=102_803_415_552,  # 95.743 GiB
        # 262144 FLOPs/cycle (as v4) × 1.75 GHz = 459e12. XLA's cost_analysis() assumes 394e12
        # (its optimal_seconds of that matmul), i.e. ~1.5 GHz: use the vendor figure for MFU.
        peak_flops=459e12, clock_hz=1.75e9,
        topology_args=_tpu_args("v5p:2x2x1", "megacore", (2, 2, 1)),
        note="one v5p VM, 4 chips in megacore mode"),
    Topology(
        name="v6e-8", platform="tpu", accelerator_type="v6e-8", num_devices=8, num_hosts=1,
        device_kind="TPU v6 lite", hbm_bytes=32 * GiB, usable_hbm_bytes=33_550_233_600,  # 31.246 GiB
        # The clock is not published: 918e12 / (4 MXUs × 256² × 2 FLOPs = 524288 FLOPs/cycle).
        peak_flops=918e12, clock_hz=1.75e9,
        topology_args=_tpu_args("v6e:2x4", "default", (2, 4, 1)),
        note="one v6e (Trillium) VM with 8 chips (2x4); clock derived, not published"),
    Topology(
        name="h100x8", platform="gpu", accelerator_type="8xH100-SXM", num_devices=8, num_hosts=1,
        device_kind="NVIDIA H100 80GB HBM3", hbm_bytes=80 * GiB,
        usable_hbm_bytes=int(_GPU_MEM_FRACTION * _H100_DEVICE_MEMORY_BYTES),  # 71.2 GiB
        # 989e12 = 132 SMs × 4096 dense bf16 FLOPs/cycle × 1.83 GHz (NVIDIA's figure); 1.98 GHz is
        # the maximum SM boost clock and the target description's clock_rate_ghz, the one XLA's GPU
        # cost model uses, so cycle estimates convert with it.
        peak_flops=989e12, clock_hz=1.98e9,
        topology_args=dict(platform="cuda", topology="1x1x8"),
        target_file="h100_sxm.txtpb",
        note="one host, 8 H100 SXM 80GB over NVLink; separate environment (launch/aot_gpu_env.sh)"),
]}


def topology(name: str) -> Topology:
    """The table's entry for ``name``; a ValueError that lists the known names otherwise."""
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}") from None


@contextlib.contextmanager
def _env_defaults(values: Mapping[str, str]) -> Iterator[None]:
    """Set the unset ones of ``values`` for the duration of the block, then unset them again
    (a variable the caller set is never touched)."""
    added = [k for k in values if k not in os.environ]
    for k in added:
        os.environ[k] = values[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _on_tpu_vm() -> bool:
    # Cloud TPU VMs: v2-v4 chips are /dev/accel<n>, v5e and later /dev/vfio/<n>.
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _libtpu_available() -> bool:
    path = os.environ.get("TPU_LIBRARY_PATH")
    return bool(path and os.path.isfile(path)) or importlib.util.find_spec("libtpu") is not None


def _plugin_loaded(platform: str) -> bool:
    """Whether a PJRT plugin (``'tpu'``: libtpu, ``'cuda'``) is loaded in this process."""
    try:
        from jax._src.lib import xla_client

        return bool(xla_client.pjrt_plugin_loaded(platform))
    except (ImportError, AttributeError):  # the private API moved: ask the dynamic loader
        marker = {"tpu": "libtpu", "cuda": "xla_cuda_plugin"}[platform]
        try:
            return marker in pathlib.Path("/proc/self/maps").read_text()
        except OSError:
            return False


def _cuda_plugin_importable() -> bool:
    # jax-cuda12-plugin is the Python package; jax-cuda12-pjrt puts the plugin library beside it.
    spec = importlib.util.find_spec("jax_plugins.xla_cuda12") if importlib.util.find_spec(
        "jax_plugins") else None
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((pathlib.Path(p) / "xla_cuda_plugin.so").is_file()
               for p in spec.submodule_search_locations)


_GPU_ENV_HINT = ("make a separate environment for GPU compiles: `bash launch/aot_gpu_env.sh "
                 "/path/to/venv-gpu` (or in a fresh venv: pip install -e \".[aot-gpu]\")")


def _tpu_devices(topo: Topology) -> list:
    if not _libtpu_available():
        raise RuntimeError(
            f"compiling for {topo.name} needs libtpu, which is not installed: "
            'pip install -e ".[aot]" (jax[tpu] of the installed jax version)')
    from jax.experimental import topologies

    env = {}
    if not _on_tpu_vm():
        # libtpu reads these once, when the first topology initialises it. Without them it takes
        # /tmp/libtpu_lockfile, so a second process compiling at the same time (another AOT probe,
        # the tests) fails with "ABORTED: Internal error when accessing libtpu multi-process
        # lockfile"; it looks for a TPU VM's metadata and prints warnings (harmless: the topology
        # is what we pass); and it writes a log file per process under /tmp/tpu_logs. On a TPU VM
        # they are left to libtpu, which there guards real chips.
        env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1",
               "TPU_ACCELERATOR_TYPE": topo.accelerator_type, "TPU_WORKER_HOSTNAMES": "localhost",
               "TPU_LOG_DIR": "disabled"}
    with _env_defaults(env):
        return list(topologies.get_topology_desc(**topo.topology_args).devices)


def _gpu_devices(topo: Topology) -> list:
    if not _cuda_plugin_importable():
        raise RuntimeError(
            f"compiling for {topo.name} needs the CUDA PJRT plugin (jax-cuda12-plugin and "
            f"jax-cuda12-pjrt of the installed jax version), which is not importable here; "
            + _GPU_ENV_HINT)
    if _plugin_loaded("tpu"):
        raise RuntimeError(
            f"libtpu is loaded in this process: compile {topo.name} in a process that made no TPU "
            "topology (libtpu and the CUDA plugin are two builds of XLA in one address space), "
            "best in an environment without libtpu; " + _GPU_ENV_HINT)
    from jax.experimental import topologies

    target_config = (TARGETS_DIR / topo.target_file).read_text()
    # Without a GPU the plugin's CUDA version check fails and the plugin is not registered, unless
    # JAX_PLATFORMS excludes cuda (e.g. 'cpu') or this is set when jax first discovers its plugins.
    with _env_defaults({"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}):
        try:
            desc = topologies.get_topology_desc(**topo.topology_args, target_config=target_config)
        except NotImplementedError as e:  # 'topology not implemented for cuda'
            raise RuntimeError(
                f"the CUDA plugin is installed but not registered with jax ({e}): jax discovered "
                "its plugins before this call on a host without CUDA. Set JAX_PLATFORMS=cpu or "
                "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before the process first uses jax") from e
    return list(desc.devices)


def compile_only_devices(name: str) -> list:
    """The compile-only devices of topology ``name`` (a key of ``TOPOLOGIES``): ``num_devices``
    of them over ``num_hosts`` process indices, for meshes of ahead-of-time compiles only.

    The same device objects on every call in a process: each get_topology_desc makes new ones,
    unequal to the last call's, and a mesh or sharding must not mix two sets.

    Raises ValueError for an unknown name, RuntimeError when the compiler plugin is missing (TPU:
    libtpu; GPU: the CUDA PJRT plugin) or, for the GPU, when libtpu is loaded in this process."""
    return list(_devices(topology(name)))


@functools.cache
def _devices(topo: Topology) -> tuple:
    # Only successes are cached: a call that raised is tried afresh next time.
    return tuple(_tpu_devices(topo) if topo.platform == "tpu" else _gpu_devices(topo))
