"""What the run's numerics and kernels are, decided from the *target* platform (the platform of
the mesh's devices, ``'cpu' | 'tpu' | 'gpu'``), never from the host that compiles: the compute dtype
``model.dtype='auto'`` resolves to (bf16 where the hardware has fast bf16 matmuls, f32 where it does
not) and the kernel family of the model (``kernels_for``).

TPUs and recent GPUs multiply bf16 at several times their f32 rate, so 'auto' is bf16 there. A
CPU is fast in bf16 only with AVX-512 BF16 or AMX; without them XLA:CPU either upcasts bf16 matmuls
to f32 or runs them slower than f32 (measured on an AVX2 Zen 3: bf16-input f32-accumulate matmul
86 GFLOP/s vs f32 120 GFLOP/s; the bf16 TaCL step 0.76× the f32 step), so 'auto' is f32 there.
Parameters, optimizer state and the losses stay f32 in both cases.
"""

from __future__ import annotations

import functools
from typing import Iterable

CHOICES = ("auto", "bfloat16", "float32", "float16")
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read); read once."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def auto_compute_dtype(backend: str, flags: Iterable[str] = ()) -> str:
    """'bfloat16' on TPU/GPU and on CPUs with bf16 matmul units, else 'float32'. Pure."""
    if backend in ("tpu", "gpu", "cuda", "rocm"):
        return "bfloat16"
    return "bfloat16" if any(f in set(flags) for f in _CPU_BF16_FLAGS) else "float32"


def resolve_compute_dtype(name: str, backend: str) -> str:
    """``model.dtype`` as configured -> the dtype the model computes in ('auto' resolved for the
    target platform ``backend``; on 'cpu' the target is this host, so its CPU flags decide)."""
    if name not in CHOICES:
        raise ValueError(f"model.dtype={name!r}: use one of {CHOICES}")
    if name != "auto":
        return name
    return auto_compute_dtype(backend, cpu_flags() if backend == "cpu" else ())


def kernels_for(platform: str) -> str:
    """``BertConfig.kernels`` for a target platform: 'cpu' (XLA:CPU's kernel forms,
    ``tacl_jax.models.layers``) on the CPU, 'xla' (plain dots and reductions) on TPUs and GPUs."""
    return "cpu" if platform == "cpu" else "xla"


def platform_of(devices) -> str:
    """The platform of a list of (real or compile-only) devices: 'cpu' | 'tpu' | 'gpu' (CUDA and
    ROCm devices report 'gpu'); a ValueError for a mix."""
    platforms = {("gpu" if d.platform in ("cuda", "rocm") else d.platform) for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"the devices span platforms {sorted(platforms)}; a mesh needs one platform")
    return platforms.pop()
