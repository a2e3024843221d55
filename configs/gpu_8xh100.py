"""The recommended TaCL run (``configs/base.py``) on one host with 8 NVIDIA H100 or H200 GPUs.

Hardware: 8 × H100/H200 (80/141 GB HBM) with NVLink, one process driving all 8 GPUs
(``launch/gpu_single_host.sh``), or one process per GPU under SLURM
(``launch/slurm_gpu.sbatch``; the same config, the distributed keys come from SLURM).
Layout: pure data parallelism (``mesh.data=8``): 32 rows of 256 tokens per GPU, bf16 compute
(``model.dtype='auto'`` on GPU), fp32 parameters and optimizer state, no rematerialisation,
layers unrolled (as on TPU, where the scanned encoder's estimate was 1.4× the unrolled one's).

    pip install -e ".[gpu]"
    WORKDIR=/data/runs/tacl_8xh100 DATA=/data/wiki_l256 HF_PATH=/data/bert-base-uncased \
        launch/gpu_single_host.sh
    # which runs:
    python -m tacl_jax.main --config=configs/gpu_8xh100.py --workdir=/data/runs/tacl_8xh100 \
        --config.init.hf_path=/data/bert-base-uncased --config.data.source=prepared:/data/wiki_l256

Compiled for 8×H100 on a CPU host (``launch/aot_gpu_env.sh``, then ``python -m tacl_jax.aot
--config=configs/gpu_8xh100.py --topology=h100x8``; memory and collectives, XLA:GPU gives no
time estimate): see docs/performance.md, *The presets on their hardware*. Measured throughput:
not yet.
"""

import os

from tacl_jax.config import load_config_file


def get_config():
    # base.py as it is: L 256, batch 256 (32 rows per GPU), 150k steps; its mesh (data=-1: pure
    # data parallelism over the 8 GPUs) and distributed.initialize='auto' (one process: none;
    # under SLURM the launcher sets the keys).
    c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))
    c.checkpoint.keep_every = 50_000      # keep every 50k-th step's checkpoint (plus the newest)
    return c
