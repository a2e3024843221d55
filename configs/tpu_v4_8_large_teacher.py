"""TaCL with a teacher larger than the student: bert-large-uncased teaching bert-base-uncased on one
Cloud TPU v4-8 host (``configs/tpu_v4_8.py`` plus ``tacl.teacher_hf_path``).

The student is ``init.hf_path`` (bert-base, 768 wide); the frozen teacher is bert-large (24 layers,
1024 wide, the same WordPiece vocabulary), sharded by the student's logical-axis rules and stored
in the compute dtype. The student learns a linear map 768 → 1024 (``TaclStudent``'s
``teacher_projection``, trained and checkpointed with it, never exported) applied to its anchors
before the token-contrastive loss; everything else is base.py's recipe. Neither the original code
nor the paper offers this (yxuansu/TaCL issue 17); it is an extension, not the paper's recipe.

    python -m tacl_jax.main --config=configs/tpu_v4_8_large_teacher.py --workdir=gs://MY_BUCKET/runs/large_teacher \\
        --config.data.source=prepared:$HOME/tacl/data/wiki_l256

Compiled for a v4-8 on a CPU host (``python -m tacl_jax.aot --config=configs/tpu_v4_8_large_teacher.py
--topology=v4-8``, with bert-large-uncased's config.json in the Hugging Face cache or
``--config.tacl.teacher_hf_path=<folder>``): see docs/performance.md, *A larger teacher*.
"""

import os

from tacl_jax.config import load_config_file


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_v4_8.py"))
    c.tacl.teacher_hf_path = "bert-large-uncased"
    return c
