"""COCO-LM's corruption and losses (arXiv 2102.08473; the corrective LM as the first author posted
it in github microsoft/COCO-LM issue #2, the pre-training code was never released), as pure
functions: arrays in, arrays out.

* corruption: one categorical sample per masked slot from the generator's softmax (temperature 1),
  written into the ``[MASK]``ed input; ``replaced = x_corr != x``;
* the sequence-contrastive views: a contiguous crop of 90% of the original with ``[CLS]`` prepended;
* the copy/binary loss (BCE on every non-pad token, label 1 = original); the corrective LM at the
  masked slots in one of ``CLM_FORMS``: the posted cross-entropy weighted by the detached
  probability of "replaced" (``'weighted_ce'``, the default) or the paper's copy mixture
  (``'copy_mixture'``, ``'copy_mixture_sg'``; ``clm_per_position``); and NT-Xent over the 2B views
  (positive = the other view of the same sequence, diagonal excluded), negatives within fixed
  groups of ``scl_group_size`` sequences (``nt_xent_per_view``).

Like ``objectives.combined``, the losses come as *sums* plus counts, so gradient accumulation
divides by the counts of the whole global batch (``coco_total``).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import ml_collections

from tacl_jax.objectives.combined import ratios_of, weighted_total
from tacl_jax.objectives.mlm import mlm_per_position

_NEG = -1e9  # finite, so a fully masked row cannot produce NaN

# config.coco_lm.clm_form: the corrective LM's loss (clm_per_position).
CLM_FORMS = ("weighted_ce", "copy_mixture", "copy_mixture_sg")

# metric name -> (numerator sum, denominator count)
RATIOS = {"gen_mlm_loss": ("gen_nll", "n_pred"), "gen_acc": ("gen_correct", "n_pred"),
          "binary_loss": ("bin_nll", "n_tok"), "binary_acc": ("bin_correct", "n_tok"),
          "clm_loss": ("clm_nll", "n_pred"), "clm_acc": ("clm_correct", "n_pred"),
          "scl_loss": ("scl_nll", "n_view"), "scl_acc": ("scl_correct", "n_view"),
          "replaced_frac": ("n_replaced", "n_pred")}
# loss weight name -> (numerator sum, denominator count)
TERMS = {"gen_mlm": ("gen_nll", "n_pred"), "binary": ("bin_nll", "n_tok"), "clm": ("clm_nll", "n_pred"),
         "scl": ("scl_nll", "n_view")}


def coco_lm_config() -> ml_collections.ConfigDict:
    """``config.coco_lm``: COCO-LM's architecture choices, options and loss weights.

    Masking is ``config.masking`` (the COCO-LM configs set ``replace_prob=1``, ``random_prob=0``:
    every selected token becomes ``[MASK]``)."""
    c = ml_collections.ConfigDict()
    c.generator_layers = 4               # same width as the main model, fewer layers
    # 'eval': sample from a second generator pass without dropout (the spec; the released code's
    # default); 'train': sample from the training pass's logits (detached), one pass fewer.
    c.generator_sample_mode = "eval"
    c.crop_fraction = 0.9                # SCL view 1: contiguous crop of this share of the tokens
    c.scl_dim = 0                        # SCL projection width; 0 = hidden size
    c.temperature = 1.0                  # NT-Xent τ
    # SCL negatives: within fixed groups of this many sequences of the step's global batch (rows
    # [g·G, (g+1)·G)), whatever the mesh and grad_accum_steps; the original's per-GPU batch of 16
    # (2048 on 128 GPUs). 0 = the whole (micro-)batch. Needs global_batch_size / grad_accum_steps
    # divisible by it. (Replaces scl_negatives='global'|'local': 'global' = 0.)
    c.scl_group_size = 16
    # 'weighted_ce' (the posted loss: CE · sg(1 − σ(z))) | 'copy_mixture' (the paper's §3.1
    # p = 1[x_corr = x]·p_copy + (1 − p_copy)·softmax, gradient into the copy head through it) |
    # 'copy_mixture_sg' (the same with p_copy detached inside the mixture). See clm_per_position.
    c.clm_form = "weighted_ce"
    c.loss_weights = ml_collections.ConfigDict(dict(gen_mlm=1.0, binary=50.0, clm=1.0, scl=1.0))
    return c


# ----------------------------------------------------------------------------- corruption

def sample_tokens(logits: jax.Array, u: jax.Array) -> jax.Array:
    """One draw per row of ``softmax(logits)`` by inverse CDF: ``logits [..., V]``, uniforms
    ``u [...]`` in [0, 1) -> ids ``[...]`` int32.

    One uniform per slot (not V Gumbels) keeps the randomness small enough to draw for the whole
    global batch up front, so the samples do not depend on sharding or on micro-batching.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    idx = jnp.sum((cdf <= u[..., None]).astype(jnp.int32), axis=-1)
    return jnp.minimum(idx, logits.shape[-1] - 1)   # u above a rounded-down cdf[-1]: the last id


def corrupt(masked_ids: jax.Array, positions: jax.Array, weights: jax.Array, samples: jax.Array,
            original_ids: jax.Array, attention_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write ``samples [B, P]`` at ``positions [B, P]`` (slots with ``weights`` > 0) into
    ``masked_ids [B, L]``. Returns ``(x_corr [B, L], replaced [B, L] bool)`` with
    ``replaced = x_corr != original`` on real tokens (a sample equal to the original is not
    replaced)."""
    b, length = masked_ids.shape
    # Padding slots point past the end and are dropped (they would otherwise all hit position 0).
    where = jnp.where(weights > 0, positions, length)
    x_corr = masked_ids.at[jnp.arange(b)[:, None], where].set(samples.astype(masked_ids.dtype), mode="drop")
    replaced = (x_corr != original_ids) & (attention_mask > 0)
    return x_corr, replaced


def crop_views(input_ids: jax.Array, attention_mask: jax.Array, token_type_ids: jax.Array, u: jax.Array,
               *, fraction: float, cls_id: int, pad_id: int) -> dict[str, jax.Array]:
    """SCL's first view: ``[CLS]`` + a contiguous crop of ``max(1, floor(fraction·m))`` of the
    ``m = n − 1`` tokens after the original's ``[CLS]`` (``n`` real tokens), at a random start
    drawn from ``u [B]`` in [0, 1). Shapes stay ``[B, L]``; the rest is padding.

    Returns ``input_ids``, ``attention_mask``, ``token_type_ids`` of the view."""
    b, length = input_ids.shape
    n = attention_mask.sum(-1).astype(jnp.int32)
    m = jnp.maximum(n - 1, 1)
    c = jnp.maximum(1, jnp.floor(fraction * m).astype(jnp.int32))
    start = 1 + jnp.minimum(jnp.floor(u * (m - c + 1)).astype(jnp.int32), m - c)   # in [1, m - c + 1]
    j = jnp.arange(length)[None]
    src = jnp.clip(start[:, None] + j - 1, 0, length - 1)
    inside = (j >= 1) & (j <= c[:, None])
    ids = jnp.where(j == 0, cls_id, jnp.where(inside, jnp.take_along_axis(input_ids, src, 1), pad_id))
    types = jnp.where(inside, jnp.take_along_axis(token_type_ids, src, 1), 0)
    mask = (j <= c[:, None]).astype(attention_mask.dtype)
    return dict(input_ids=ids.astype(input_ids.dtype), attention_mask=mask,
                token_type_ids=types.astype(token_type_ids.dtype))


# ----------------------------------------------------------------------------- losses

def binary_per_token(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``logits [B, L]`` (z_i), ``labels [B, L]`` (y_i = 1: original, 0: replaced) ->
    ``(bce [B, L], correct [B, L])``; stable ``softplus(z) − z·y``."""
    z = logits.astype(jnp.float32)
    y = labels.astype(jnp.float32)
    return jax.nn.softplus(z) - z * y, ((z > 0) == (y > 0.5)).astype(jnp.float32)


def binary_loss(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean BCE over the tokens with ``mask [B, L]`` = 1, and the accuracy there."""
    bce, correct = binary_per_token(logits, labels)
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    return (bce * m).sum() / n, (correct * m).sum() / n


def clm_per_position(logits: jax.Array, targets: jax.Array, binary_logits: jax.Array,
                     copied: jax.Array | None = None, form: str = "weighted_ce") -> tuple[jax.Array, jax.Array]:
    """The corrective LM at the masked slots, per slot.

    Inputs: ``logits [B, P, V]`` (the LM logits ``h·Eᵀ + b`` at the slots), ``targets [B, P]``
    (original ids), ``binary_logits [B, P]`` (the copy head's z at those slots,
    ``p_copy(1|h) = σ(z)``, "the input token is the original"), ``copied [B, P]`` bool (the
    corrupted token there equals the original: a sample that drew the original back; needed by
    the mixture forms only). Returns ``(nll [B, P], correct [B, P])``; ``correct`` = the LM
    softmax's argmax is the original (in every form, so the metric compares across them).

    ``form`` (``CLM_FORMS``; ``config.coco_lm.clm_form``):

    * ``'weighted_ce'`` (the loss the first author posted in microsoft/COCO-LM issue #2, the
      default): ``nll = sg(1 − σ(z)) · CE``, ``CE = −log softmax(logits)[target]``. The weight is
      detached: the LM term trains the encoder and the LM head only, never the copy head (which
      learns from the binary loss alone).
    * ``'copy_mixture'`` (the paper, arXiv 2102.08473 §3.1): the probability of the original is
      the copy mixture ``p = 1[copied] · σ(z) + σ(−z) · softmax(logits)[target]`` and
      ``nll = −log p``, computed in log space as ``logaddexp(log σ(z), log σ(−z) − CE)`` where
      copied and ``log σ(−z) − CE`` elsewhere (``log σ(±z) = −softplus(∓z)``: no log(0), no
      overflow). Gradients flow into the LM logits and **into z through the mixture**: the copy
      head is trained by this term too (on top of the binary loss); where not copied the term is
      ``softplus(z) + CE``, which pushes z down (towards "replaced") as well as fitting the LM.
    * ``'copy_mixture_sg'``: the same value with ``σ(±z)`` detached inside the mixture (the copy
      head again learns from the binary loss alone; the LM gradient is the CE's times
      ``σ(−z)·s / (1[copied]·σ(z) + σ(−z)·s)``, s = the softmax of the target: 1 where not copied).
      Kept because whether the paper's final version stops this gradient is not settled here.
    """
    nll, correct = mlm_per_position(logits, targets)
    z = binary_logits.astype(jnp.float32)
    if form == "weighted_ce":
        p_replaced = jax.lax.stop_gradient(jax.nn.sigmoid(-z))      # 1 − σ(z)
        return p_replaced * nll, correct
    if form not in CLM_FORMS:
        raise ValueError(f"coco_lm.clm_form={form!r}: use one of {CLM_FORMS}")
    if copied is None:
        raise ValueError(f"clm_form={form!r} needs `copied` (the slots whose corrupted token is the original)")
    log_copy, log_lm = -jax.nn.softplus(-z), -jax.nn.softplus(z)   # log σ(z), log σ(−z)
    if form == "copy_mixture_sg":
        log_copy, log_lm = jax.lax.stop_gradient(log_copy), jax.lax.stop_gradient(log_lm)
    from_lm = log_lm - nll
    log_p = jnp.where(copied, jnp.logaddexp(log_copy, from_lm), from_lm)
    return -log_p, correct


def clm_loss(logits: jax.Array, targets: jax.Array, binary_logits: jax.Array, weights: jax.Array,
             copied: jax.Array | None = None, form: str = "weighted_ce") -> tuple[jax.Array, jax.Array]:
    """Mean ``clm_per_position`` over the slots with ``weights [B, P]`` = 1 (``Σ_M nll / |M|``),
    and the accuracy there."""
    nll, correct = clm_per_position(logits, targets, binary_logits, copied, form)
    w = weights.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    return (nll * w).sum() / n, (correct * w).sum() / n


def _normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-24))


def nt_xent_per_view(q: jax.Array, k: jax.Array, temperature: float = 1.0, group_size: int = 0
                     ) -> tuple[jax.Array, jax.Array]:
    """NT-Xent over the 2B views ``[q; k]`` within groups of sequences.

    ``q, k [B, D]`` (any float dtype; L2-normalised here, in f32): row i of q and of k are the two
    views of sequence i. Group g = sequences ``[g·G, (g+1)·G)`` (``G = group_size``; 0 = one
    group of all B); ``B % G`` must be 0. For each of the 2G views of a group the positive is the
    other view of its sequence and the candidates are every view of its group but itself (2G − 1:
    one positive, 2G − 2 negatives), ``s = cos / temperature``::

        nll = logsumexp_{j ≠ a, j in group} s_aj − s_a,pos

    Returns ``(nll [2, B], correct [2, B])`` (row 0: anchors from q, row 1: from k; ``correct`` =
    the most similar other view is the positive).
    """
    b, d = q.shape
    n = int(group_size) or b
    if n < 0 or b % n:
        raise ValueError(f"a batch of {b} sequences does not split into SCL negative groups of {group_size}")
    g = b // n
    z = jnp.stack([_normalize(q).reshape(g, n, d), _normalize(k).reshape(g, n, d)], axis=1)  # [g, 2, n, D]
    z = z.reshape(g, 2 * n, d)
    s = jnp.einsum("gid,gjd->gij", z, z, preferred_element_type=jnp.float32) / temperature
    eye = jnp.eye(2 * n, dtype=bool)
    s = jnp.where(eye[None], _NEG, s)
    pos_idx = (jnp.arange(2 * n) + n) % (2 * n)                                               # the other view
    positive = jnp.take_along_axis(s, jnp.broadcast_to(pos_idx[None, :, None], (g, 2 * n, 1)), axis=-1)[..., 0]
    nll = jax.nn.logsumexp(s, axis=-1) - positive
    correct = (jnp.argmax(s, axis=-1) == pos_idx[None]).astype(jnp.float32)
    # [g, 2n] = [g, (view, row)] -> [2, B]
    unflat = lambda x: jnp.swapaxes(x.reshape(g, 2, n), 0, 1).reshape(2, b)
    return unflat(nll), unflat(correct)


def nt_xent_loss(q: jax.Array, k: jax.Array, temperature: float = 1.0, group_size: int = 0
                 ) -> tuple[jax.Array, jax.Array]:
    """Mean NT-Xent over the 2B views, and the share whose most similar view is their positive."""
    nll, correct = nt_xent_per_view(q, k, temperature, group_size)
    return nll.mean(), correct.mean()


# ----------------------------------------------------------------------------- combination

def coco_sums(*, gen_logits: jax.Array, targets: jax.Array, weights: jax.Array, replaced: jax.Array,
              attention_mask: jax.Array, binary_logits: jax.Array, clm_logits: jax.Array,
              positions: jax.Array, scl_q: jax.Array | None, scl_k: jax.Array | None,
              temperature: float = 1.0, scl_group_size: int = 0, clm_form: str = "weighted_ce"
              ) -> dict[str, jax.Array]:
    """Loss sums and counts of one (micro-)batch. Shapes: ``gen_logits``, ``clm_logits``
    ``[B, P, V]`` at ``positions [B, P]``; ``targets``, ``weights`` ``[B, P]``; ``replaced``,
    ``attention_mask``, ``binary_logits`` ``[B, L]``; ``scl_q``, ``scl_k`` ``[B, D]`` or None
    (SCL negatives within groups of ``scl_group_size`` rows of this batch, 0 = all of it)."""
    w = weights.astype(jnp.float32)
    tok = attention_mask.astype(jnp.float32)
    gen_nll, gen_correct = mlm_per_position(gen_logits, targets)
    bin_nll, bin_correct = binary_per_token(binary_logits, 1 - replaced.astype(jnp.int32))
    z_at = jnp.take_along_axis(binary_logits, positions.astype(jnp.int32), axis=1)
    replaced_at = jnp.take_along_axis(replaced, positions.astype(jnp.int32), axis=1)
    copied_at = jnp.logical_not(replaced_at.astype(bool))            # the sample drew the original back
    clm_nll, clm_correct = clm_per_position(clm_logits, targets, z_at, copied_at, clm_form)
    replaced_at = replaced_at.astype(jnp.float32)
    out = dict(gen_nll=(gen_nll * w).sum(), gen_correct=(gen_correct * w).sum(), n_pred=w.sum(),
               bin_nll=(bin_nll * tok).sum(), bin_correct=(bin_correct * tok).sum(), n_tok=tok.sum(),
               clm_nll=(clm_nll * w).sum(), clm_correct=(clm_correct * w).sum(),
               n_replaced=(replaced_at * w).sum())
    if scl_q is not None:
        nll, correct = nt_xent_per_view(scl_q, scl_k, temperature, scl_group_size)
        out.update(scl_nll=nll.sum(), scl_correct=correct.sum(), n_view=jnp.asarray(nll.size, jnp.float32))
    return out


def coco_total(sums: Mapping[str, jax.Array], counts: Mapping[str, jax.Array],
               weights: Mapping[str, float]) -> jax.Array:
    """``mean_M CE_gen·w_gen + w_bin·L_bin + w_clm·L_clm + w_scl·L_scl`` as ``Σ w·sum/count`` with
    the counts (``n_pred``, ``n_tok``, ``n_view``) of the whole global batch."""
    return weighted_total(sums, counts, weights, TERMS)


def coco_ratios(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-term mean losses and accuracies (and ``replaced_frac``) from accumulated sums."""
    return ratios_of(sums, RATIOS)
