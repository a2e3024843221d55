"""The paper's recipe (``configs/base.py``) on one host with 8 NVIDIA H100 or H200 GPUs.

Hardware: 8 × H100/H200 (80/141 GB HBM) with NVLink, one process driving all 8 GPUs
(``launch/gpu_single_host.sh``), or one process per GPU under SLURM
(``launch/slurm_gpu.sbatch``; the same config, the distributed keys come from SLURM).
Layout: pure data parallelism (``mesh.data=8``): 32 rows of 256 tokens per GPU, bf16 compute,
fp32 parameters and optimizer state, no rematerialisation; the layers run as one ``nn.scan``
(``model.scan_layers``: one layer body to compile; checkpoints stack the layers on a leading
axis, exports are ordinary Hugging Face folders).

    pip install -e ".[gpu]"
    WORKDIR=/data/runs/tacl_8xh100 DATA=/data/wiki_l256 HF_PATH=/data/bert-base-uncased \
        launch/gpu_single_host.sh
    # which runs:
    python -m tacl_jax.main --config=configs/gpu_8xh100.py --workdir=/data/runs/tacl_8xh100 \
        --config.init.hf_path=/data/bert-base-uncased --config.data.source=prepared:/data/wiki_l256

Expected throughput: not yet measured (tokens/s and MFU to be filled in from a real run's
``metrics.jsonl``). For scale: ≈ 7.4e8 model FLOPs per token (``tacl_jax.flops``), so 100% MFU on
8 × 989 TFLOP/s (dense bf16) would be ≈ 1.1e7 tokens/s; with 32 rows per GPU the step is short
and the real fraction will be well below that.
"""

import os

from tacl_jax.config import load_config_file


def _base_config():
    return load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))


def get_config():
    c = _base_config()                    # the paper: L 256, batch 256, 150k steps, lr 1e-4, τ 0.01
    c.mesh.update(data=-1, fsdp=1, tensor=1)
    c.mesh_devices = 0
    c.distributed.initialize = "auto"     # one process: none; under SLURM the launcher sets the keys
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "none"
    c.model.scan_layers = True            # one compiled layer body: params encoder/layers/... [12, ...]
    c.global_batch_size = 256             # 32 rows per GPU
    c.grad_accum_steps = 1
    c.checkpoint.every = 1000
    c.checkpoint.keep = 3
    c.checkpoint.keep_every = 50_000
    c.log_every = 100
    return c
