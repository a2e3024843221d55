"""COCO-LM base from scratch (arXiv 2102.08473), the reconstructed recipe of
``../shared/docs/method.md`` §2.

    python -m tacl_jax.main --config=configs/coco_lm_base.py --workdir=gs://BUCKET/coco_base \
        --config.init.tokenizer_path=/path/bert-base-uncased --config.data.source=...

Main model: BERT-base (12 layers, 768 hidden, 12 heads, 3072 FFN, uncased 30,522 WordPiece
vocabulary); generator: 4 layers of the same width sharing the embeddings. L = 512, global batch
2048, 125k steps, Adam (0.9, 0.98), eps 1e-6, lr 5e-4 with 10k warm-up then linear decay,
weight decay 0.01, clip 2.0. Loss: gen MLM + 50·binary + CLM + SCL (τ = 1, crop 90%, global
negatives). The paper's base model used relative position buckets (not here: absolute positions,
so the export is a plain BertForMaskedLM). Expected (paper): MNLI ≈ ELECTRA-base's with half its
GPU hours; during pre-training ``replaced_frac`` settles well below 1 as the generator learns, and
``binary_acc`` stays above the all-original share. Throughput here: not yet measured.

Hardware: verified to compile and fit on one TPU v4-8 (4 devices, pure data parallelism) with
gradient accumulation, ``grad_accum_steps = 32``: 32 micro-batches of 64 sequences (16 per
chip) × L 512, no rematerialisation, unrolled layers, bf16 compute. Compiler figures
(``python -m tacl_jax.aot --config=configs/coco_lm_base.py --topology=v4-8``, jax 0.10.2; not a
measurement): peak 15.32 GiB of 30.75 GiB usable HBM per device (50%); collectives 0.570 GB
per step, the gradients all-reduced once after the micro-batch loop (7 all-reduces, 554 MB;
``train.step.accumulate``) plus SCL's all-gather of the view embeddings per micro-batch (64,
12.6 MB in all); estimated step 6.50 s (≈ 40k tokens/s/chip, MFU ≈ 21% by XLA's pessimistic
cycle estimate). Without accumulation the step needs 277.6 GiB of temporaries per device;
16 micro-batches peak at 29.20 GiB (95%, over the 90% margin kept for the runtime), est. 9.30 s.
A larger slice needs fewer micro-batches (a v4-64, 32 devices: 64 rows per device per step,
``grad_accum_steps = 4`` keeps the same 16 rows per device per micro-batch); the global batch
(2048) and the recipe do not change with ``grad_accum_steps``.
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
    # v4-8: 32 micro-batches of 64 sequences (16 per chip); see the docstring for the figures.
    c.grad_accum_steps = 32
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
