"""The recommended TaCL run (``configs/base.py``) on one Cloud TPU v4-8 host.

Hardware: TPU v4-8 = one host, 4 chips, 4 JAX devices (each chip's two TensorCores form one
megacore device), 32 GiB HBM per chip (30.75 GiB usable); runtime ``tpu-ubuntu2204-base``, zone
``us-central2-b``. Layout: pure data parallelism (``mesh.data=4``): 64 rows of 256 tokens per chip,
bf16 compute (``model.dtype='auto'`` on TPU) with fp32 parameters and optimizer state, no
rematerialisation, layers unrolled.

    ACCELERATOR_TYPE=v4-8 BUCKET=gs://MY_BUCKET DATA=gs://MY_BUCKET/data/wiki_l256 \
        launch/tpu_vm.sh create setup train          # see launch/README.md
    # or, on the VM itself:
    python -m tacl_jax.main --config=configs/tpu_v4_8.py --workdir=gs://MY_BUCKET/runs/tacl_v4_8 \
        --config.init.hf_path=$HOME/tacl/models/bert-base-uncased \
        --config.data.source=prepared:$HOME/tacl/data/wiki_l256

Compiled for a v4-8 on a CPU host (``python -m tacl_jax.aot --config=configs/tpu_v4_8.py
--topology=v4-8``; compiler figures, the step time an estimate, not a measurement): see
docs/performance.md, *The presets on their hardware*. ``model.scan_layers`` stays False: scanned,
the estimate was 289 ms vs 209 ms unrolled (the stacked weights' per-layer slices are copied, 3.6 GB/step) with twice the
temporaries (19.9 vs 11.0 GiB peak); the unrolled compile took 5.3 min on a 2-core host (once).
Measured throughput on a v4-8: not yet (fill in from a real run's ``metrics.jsonl``).
"""

import os

from tacl_jax.config import load_config_file


def get_config():
    # base.py as it is: L 256, batch 256 (64 rows per chip), 150k steps, lr 1e-4, τ 0.01; its mesh
    # (data=-1: pure data parallelism over the host's 4 chips) and distributed.initialize='auto'
    # (one host: no jax.distributed needed).
    c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))
    c.checkpoint.keep_every = 50_000      # keep every 50k-th step's checkpoint (plus the newest)
    return c
