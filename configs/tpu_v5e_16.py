"""The recommended TaCL run (``configs/base.py``) on a Cloud TPU v5e-16 pod slice (``v5litepod-16``).

Hardware: 16 v5e chips on 4 hosts (4 chips and one JAX process each), 16 GiB HBM per chip;
runtime ``v2-alpha-tpuv5-lite``, zone e.g. ``us-west4-a``. Every host runs the same command
(``launch/tpu_vm.sh train`` does this with ``--worker=all``); ``distributed.initialize='auto'``
finds the 4 hosts in the Cloud TPU metadata and initialises ``jax.distributed`` from it.
Layout: pure data parallelism over the 16 chips (``mesh.data=16``): 16 rows of 256 tokens per
chip, each host feeding 64 rows; bf16 compute (``model.dtype='auto'`` on TPU), fp32 parameters
and optimizer state, no rematerialisation, layers unrolled.

    ACCELERATOR_TYPE=v5litepod-16 BUCKET=gs://MY_BUCKET DATA=gs://MY_BUCKET/data/wiki_l256 \
        launch/tpu_vm.sh create setup train          # see launch/README.md

Compiled for a v5e-16 on a CPU host (``python -m tacl_jax.aot --config=configs/tpu_v5e_16.py
--topology=v5e-16``; compiler figures, the step time an estimate): see docs/performance.md,
*The presets on their hardware*. ``model.scan_layers`` stays False: scanned, the estimate was
84.9 ms vs 59.5 ms unrolled, with twice the temporaries (6.5 vs 3.9 GiB peak of 15.75). With 16 rows per chip the step is
short; a larger ``global_batch_size`` (and learning rate) would use the chips better but is no
longer the paper's recipe. Measured throughput: not yet (fill in from a real run's ``metrics.jsonl``).
"""

import os

from tacl_jax.config import load_config_file


def get_config():
    # base.py as it is: L 256, batch 256 (64 rows per host), 150k steps; its mesh (data=-1: pure
    # data parallelism over the 16 chips) and distributed.initialize='auto' (4 hosts found in the
    # Cloud TPU metadata: jax.distributed.initialize()).
    c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))
    c.checkpoint.keep_every = 50_000      # keep every 50k-th step's checkpoint (plus the newest)
    return c
