"""COCO-LM base from scratch (arXiv 2102.08473): the pre-training recipe reconstructed from the
paper, the released model code (github microsoft/COCO-LM) and the loss posted in its issue #2.

    python -m tacl_jax.main --config=configs/coco_lm_base.py --workdir=gs://BUCKET/coco_base \
        --config.init.tokenizer_path=/path/bert-base-uncased --config.data.source=...

Main model: BERT-base (12 layers, 768 hidden, 12 heads, 3072 FFN, uncased 30,522 WordPiece
vocabulary); generator: 4 layers of the same width sharing the embeddings. L = 512, global batch
2048, 125k steps, Adam (0.9, 0.98), eps 1e-6, lr 5e-4 with 10k warm-up then linear decay,
weight decay 0.01, clip 2.0. Loss: gen MLM + 50·binary + CLM (the posted weighted cross-entropy,
``coco_lm.clm_form='weighted_ce'``) + SCL (τ = 1, crop 90%, negatives within groups of 16
sequences, ``coco_lm.scl_group_size = 16``: the posted code's per-GPU batch, 2048 on 128 GPUs).
Expected (paper): MNLI ≈ ELECTRA-base's with half its GPU hours; during pre-training
``replaced_frac`` settles well below 1 as the generator learns, and ``binary_acc`` stays above
the all-original share. Throughput here: not yet measured.

Differences from the paper and the released code / posted recipe (microsoft/COCO-LM, its fairseq
``models/cocolm/model.py`` and the loss posted in its issue #2), as far as known:

* **No relative position bias.** The released COCO-LM models add T5-style relative position
  buckets to the attention logits of every layer of both networks (``rel_pos=1``,
  ``rel_pos_bins=32``, ``max_rel_pos=128``, on top of learned absolute positions); here only
  BERT's learned absolute positions, so the export is a plain ``BertForMaskedLM``.
* **Token types.** The released model has no token-type (segment) embeddings
  (``num_segments=0``); here BERT's (``type_vocab_size=2``), shared with the generator.
* **Vocabulary.** BERT's uncased WordPiece (30,522); the released models use their own
  sentencepiece/BPE dictionary (fairseq), so checkpoints and tokenizations do not interchange.
* **Data.** Whatever ``config.data`` points at; the paper's base setting pre-trains on
  Wikipedia + BookCorpus (16 GB), its ``++`` models on 160 GB.
* **Weight decay** skips biases and LayerNorm parameters (``train.optimizer.decay_mask``);
  fairseq's Adam decays every parameter.
* **Precision.** bf16 compute with f32 parameters and f32 losses; the original trained in fp16
  mixed precision.
* **Corrective LM.** The default is the posted loss, ``sg(1 − σ(z))·CE`` (the copy head learns
  from the binary loss only); the paper's §3.1 copy mixture, ``−log(1[x_corr = x]·p_copy +
  (1 − p_copy)·softmax)``, is ``coco_lm.clm_form='copy_mixture'`` (gradient into the copy head
  through it) or ``'copy_mixture_sg'`` (p_copy detached).
* **SCL negatives.** Groups of 16 consecutive sequences of the step's global batch, fixed
  whatever the mesh and ``grad_accum_steps``; the original took each GPU's local batch of 16 (the
  same in distribution: the batch order is shuffled). 0 = the whole micro-batch.
* **Loss normalisation.** Each term is a mean over the whole global batch's tokens / masked slots
  / views; a per-GPU mean averaged over GPUs (if the original normalised that way) weights rows
  slightly differently when their token counts differ.
* **Sampling.** One inverse-CDF draw per masked slot from the generator's softmax (temperature 1)
  instead of ``torch.multinomial``: the same distribution, other random numbers.
* **Hardware.** One v4-8 with 32 micro-batches instead of 128 GPUs: the same global batch and
  gradient; dropout masks differ.

Hardware: verified to compile and fit on one TPU v4-8 (4 devices, pure data parallelism) with
gradient accumulation, ``grad_accum_steps = 32``: 32 micro-batches of 64 sequences (16 per
chip) × L 512, no rematerialisation, unrolled layers, bf16 compute. Compiler figures
(``python -m tacl_jax.aot --config=configs/coco_lm_base.py --topology=v4-8``, jax 0.10.2; not a
measurement): peak 15.32 GiB of 30.75 GiB usable HBM per device (50%); collectives 0.570 GB
per step, the gradients all-reduced once after the micro-batch loop (7 all-reduces, 554 MB;
``train.step.accumulate``) plus SCL's all-gather of the view embeddings per micro-batch (64,
12.6 MB in all; measured with the whole micro-batch as SCL negatives: with groups of 16 each chip's
16 rows of a micro-batch are one group and the SCL needs no collective; figures not re-measured
since); estimated step 6.50 s (≈ 40k tokens/s/chip, MFU ≈ 21% by XLA's pessimistic
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
    # generator 4 layers, weights gen 1 / binary 50 / clm 1 / scl 1, SCL groups of 16, posted CLM
    c.coco_lm = coco_lm_config()
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
