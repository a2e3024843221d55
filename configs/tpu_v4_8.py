"""The paper's recipe (``configs/base.py``) on one Cloud TPU v4-8 host.

Hardware: TPU v4-8 = one host, 4 chips, 4 JAX devices (each chip's two TensorCores form one
megacore device), 32 GiB HBM per chip; runtime ``tpu-ubuntu2204-base``, zone ``us-central2-b``.
Layout: pure data parallelism (``mesh.data=4``): 64 rows of 256 tokens per chip, bf16 compute
with fp32 parameters and optimizer state, no rematerialisation (BERT-base fits easily);
the layers run as one ``nn.scan`` (``model.scan_layers``: one layer body to compile; checkpoints
stack the layers on a leading axis, exports are ordinary Hugging Face folders).

    ACCELERATOR_TYPE=v4-8 BUCKET=gs://MY_BUCKET DATA=gs://MY_BUCKET/data/wiki_l256 \
        launch/tpu_vm.sh create setup train          # see launch/README.md
    # or, on the VM itself:
    python -m tacl_jax.main --config=configs/tpu_v4_8.py --workdir=gs://MY_BUCKET/runs/tacl_v4_8 \
        --config.init.hf_path=$HOME/tacl/models/bert-base-uncased \
        --config.data.source=prepared:$HOME/tacl/data/wiki_l256

Expected throughput: not yet measured (tokens/s and MFU to be filled in from a real run's
``metrics.jsonl``). For scale: one step is 256 × 256 = 65,536 tokens and ≈ 7.4e8 model FLOPs
per token (``tacl_jax.flops``: student fwd+bwd, teacher fwd), so 100% MFU on 4 × 275 TFLOP/s
would be ≈ 1.5e6 tokens/s; the real number is a fraction of that.
"""

import os

from tacl_jax.config import load_config_file


def _base_config():
    return load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))


def get_config():
    c = _base_config()                    # the paper: L 256, batch 256, 150k steps, lr 1e-4, τ 0.01
    c.mesh.update(data=-1, fsdp=1, tensor=1)
    c.mesh_devices = 0
    c.distributed.initialize = "auto"     # one host: no jax.distributed needed
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "none"
    c.model.scan_layers = True            # one compiled layer body: params encoder/layers/... [12, ...]
    c.global_batch_size = 256
    c.grad_accum_steps = 1
    c.checkpoint.every = 1000
    c.checkpoint.keep = 3
    c.checkpoint.keep_every = 50_000
    c.log_every = 100
    return c
