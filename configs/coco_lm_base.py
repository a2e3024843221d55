"""COCO-LM base from scratch (arXiv 2102.08473), the reconstructed recipe of
``../shared/docs/method.md`` §2.

    python -m tacl_jax.main --config=configs/coco_lm_base.py --workdir=gs://BUCKET/coco_base \
        --config.init.tokenizer_path=/path/bert-base-uncased --config.data.source=...

Main model: BERT-base (12 layers, 768 hidden, 12 heads, 3072 FFN, uncased 30,522 WordPiece
vocabulary); generator: 4 layers of the same width sharing the embeddings. L = 512, global batch
2048, 125k steps, Adam (0.9, 0.98), eps 1e-6, lr 5e-4 with 10k warm-up then linear decay,
weight decay 0.01, clip 2.0. Loss: gen MLM + 50·binary + CLM + SCL (τ = 1, crop 90%, global
negatives). The paper's base model used relative position buckets (not here: absolute positions,
so the export is a plain BertForMaskedLM). Hardware: a TPU v4-64 / 32+ GPUs class; at smaller
scale raise ``grad_accum_steps``. Expected (paper): MNLI ≈ ELECTRA-base's with half its GPU hours;
during pre-training ``replaced_frac`` settles well below 1 as the generator learns, and
``binary_acc`` stays above the all-original share. Throughput here: not yet measured.
"""

from tacl_jax.config import default_config
from tacl_jax.objectives.coco_lm import coco_lm_config


def get_config():
    c = default_config()
    c.objective = "coco_lm"
    c.coco_lm = coco_lm_config()         # generator 4 layers, weights gen 1 / binary 50 / clm 1 / scl 1
    c.init.scratch.update(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                          intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2)
    c.masking.mask_prob = 0.15
    c.masking.replace_prob = 1.0         # every selected token → [MASK]
    c.masking.random_prob = 0.0
    c.max_len = 512
    c.global_batch_size = 2048
    c.num_train_steps = 125_000
    c.optim.learning_rate = 5e-4
    c.optim.warmup_steps = 10_000
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.eps = 1e-6
    c.optim.weight_decay = 0.01
    c.optim.clip_norm = 2.0
    c.log_every = 100
    return c
