"""The paper's recipe (``configs/base.py``) on a Cloud TPU v5e-16 pod slice (``v5litepod-16``).

Hardware: 16 v5e chips on 4 hosts (4 chips and one JAX process each), 16 GiB HBM per chip;
runtime ``v2-alpha-tpuv5-lite``, zone e.g. ``us-west4-a``. Every host runs the same command
(``launch/tpu_vm.sh train`` does this with ``--worker=all``); ``distributed.initialize='auto'``
finds the 4 hosts in the Cloud TPU metadata and initialises ``jax.distributed`` from it.
Layout: pure data parallelism over the 16 chips (``mesh.data=16``): 16 rows of 256 tokens per
chip, each host feeding 64 rows; bf16 compute, fp32 parameters and optimizer state, no
rematerialisation (BERT-base with its frozen teacher needs a few GiB of the 16); the layers run
as one ``nn.scan`` (``model.scan_layers``: one layer body to compile; checkpoints stack the
layers on a leading axis, exports are ordinary Hugging Face folders).

    ACCELERATOR_TYPE=v5litepod-16 BUCKET=gs://MY_BUCKET DATA=gs://MY_BUCKET/data/wiki_l256 \
        launch/tpu_vm.sh create setup train          # see launch/README.md

Expected throughput: not yet measured (tokens/s and MFU to be filled in from a real run's
``metrics.jsonl``). For scale: ≈ 7.4e8 model FLOPs per token (``tacl_jax.flops``), so 100% MFU on
16 × 197 TFLOP/s would be ≈ 4.3e6 tokens/s; with only 16 rows per chip the step is short and
the real fraction may be low. Raising ``global_batch_size`` (and the learning rate) would use
the chips better but is no longer the paper's recipe.
"""

import os

from tacl_jax.config import load_config_file


def _base_config():
    return load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))


def get_config():
    c = _base_config()                    # the paper: L 256, batch 256, 150k steps, lr 1e-4, τ 0.01
    c.mesh.update(data=-1, fsdp=1, tensor=1)
    c.mesh_devices = 0
    c.distributed.initialize = "auto"     # 4 hosts (Cloud TPU metadata): jax.distributed.initialize()
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "none"
    c.model.scan_layers = True            # one compiled layer body: params encoder/layers/... [12, ...]
    c.global_batch_size = 256             # 64 rows per host, 16 per chip
    c.grad_accum_steps = 1
    c.checkpoint.every = 1000
    c.checkpoint.keep = 3
    c.checkpoint.keep_every = 50_000
    c.log_every = 100
    return c
