"""COCO-LM's corruption and losses (arXiv 2102.08473, ``../shared/docs/method.md`` §2), as pure
functions: arrays in, arrays out.

* corruption: one categorical sample per masked slot from the generator's softmax (temperature 1),
  written into the ``[MASK]``ed input; ``replaced = x_corr != x``;
* the sequence-contrastive views: a contiguous crop of 90% of the original with ``[CLS]`` prepended;
* the copy/binary loss (BCE on every non-pad token, label 1 = original), the corrective LM
  (cross-entropy at the masked slots weighted by the detached probability of "replaced") and
  NT-Xent over the 2B views (positive = the other view of the same sequence, diagonal excluded).

Like ``objectives.combined``, the losses come as *sums* plus counts, so gradient accumulation
divides by the counts of the whole global batch (``coco_total``).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import ml_collections

from tacl_jax.objectives.mlm import mlm_per_position

_NEG = -1e9  # finite, so a fully masked row cannot produce NaN

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
    c.scl_negatives = "global"           # 'global' (whole (micro-)batch) | 'local' (per data shard)
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


def clm_per_position(logits: jax.Array, targets: jax.Array, binary_logits: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """Corrective LM: ``logits [B, P, V]`` at the masked slots, ``targets [B, P]`` (original ids),
    ``binary_logits [B, P]`` (z at those slots) -> ``(sg(1 − σ(z))·CE [B, P], correct [B, P])``."""
    nll, correct = mlm_per_position(logits, targets)
    p_replaced = jax.lax.stop_gradient(jax.nn.sigmoid(-binary_logits.astype(jnp.float32)))  # 1 − σ(z)
    return p_replaced * nll, correct


def clm_loss(logits: jax.Array, targets: jax.Array, binary_logits: jax.Array, weights: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """``Σ_M sg(1 − σ(z))·CE / |M|`` over the slots with ``weights [B, P]`` = 1, and the accuracy."""
    nll, correct = clm_per_position(logits, targets, binary_logits)
    w = weights.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    return (nll * w).sum() / n, (correct * w).sum() / n


def _normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-24))


def nt_xent_per_view(q: jax.Array, k: jax.Array, temperature: float = 1.0, groups: int = 1
                     ) -> tuple[jax.Array, jax.Array]:
    """NT-Xent over the 2B views ``[q; k]`` (``q, k [B, D]``; row i of q and of k are one
    sequence): for each view the positive is the other view of its sequence, the negatives every
    other view of its group, itself excluded. ``groups`` splits the batch into that many
    contiguous row blocks (one per data shard: "local" negatives); 1 = the whole batch.

    Returns ``(nll [2, B], correct [2, B])`` (row 0: anchors from q, row 1: from k)."""
    b, d = q.shape
    if b % groups:
        raise ValueError(f"a batch of {b} sequences does not split into {groups} negative groups")
    g, n = groups, b // groups
    z = jnp.stack([_normalize(q).reshape(g, n, d), _normalize(k).reshape(g, n, d)], axis=1)  # [G, 2, n, D]
    z = z.reshape(g, 2 * n, d)
    s = jnp.einsum("gid,gjd->gij", z, z, preferred_element_type=jnp.float32) / temperature
    eye = jnp.eye(2 * n, dtype=bool)
    s = jnp.where(eye[None], _NEG, s)
    pos_idx = (jnp.arange(2 * n) + n) % (2 * n)                                               # the other view
    positive = jnp.take_along_axis(s, jnp.broadcast_to(pos_idx[None, :, None], (g, 2 * n, 1)), axis=-1)[..., 0]
    nll = jax.nn.logsumexp(s, axis=-1) - positive
    correct = (jnp.argmax(s, axis=-1) == pos_idx[None]).astype(jnp.float32)
    # [G, 2n] = [G, (view, row)] -> [2, B]
    unflat = lambda x: jnp.swapaxes(x.reshape(g, 2, n), 0, 1).reshape(2, b)
    return unflat(nll), unflat(correct)


def nt_xent_loss(q: jax.Array, k: jax.Array, temperature: float = 1.0, groups: int = 1
                 ) -> tuple[jax.Array, jax.Array]:
    """Mean NT-Xent over the 2B views, and the share whose most similar view is their positive."""
    nll, correct = nt_xent_per_view(q, k, temperature, groups)
    return nll.mean(), correct.mean()


# ----------------------------------------------------------------------------- combination

def coco_sums(*, gen_logits: jax.Array, targets: jax.Array, weights: jax.Array, replaced: jax.Array,
              attention_mask: jax.Array, binary_logits: jax.Array, clm_logits: jax.Array,
              positions: jax.Array, scl_q: jax.Array | None, scl_k: jax.Array | None,
              temperature: float = 1.0, scl_groups: int = 1) -> dict[str, jax.Array]:
    """Loss sums and counts of one (micro-)batch. Shapes: ``gen_logits``, ``clm_logits``
    ``[B, P, V]`` at ``positions [B, P]``; ``targets``, ``weights`` ``[B, P]``; ``replaced``,
    ``attention_mask``, ``binary_logits`` ``[B, L]``; ``scl_q``, ``scl_k`` ``[B, D]`` or None."""
    w = weights.astype(jnp.float32)
    tok = attention_mask.astype(jnp.float32)
    gen_nll, gen_correct = mlm_per_position(gen_logits, targets)
    bin_nll, bin_correct = binary_per_token(binary_logits, 1 - replaced.astype(jnp.int32))
    z_at = jnp.take_along_axis(binary_logits, positions.astype(jnp.int32), axis=1)
    clm_nll, clm_correct = clm_per_position(clm_logits, targets, z_at)
    replaced_at = jnp.take_along_axis(replaced, positions.astype(jnp.int32), axis=1).astype(jnp.float32)
    out = dict(gen_nll=(gen_nll * w).sum(), gen_correct=(gen_correct * w).sum(), n_pred=w.sum(),
               bin_nll=(bin_nll * tok).sum(), bin_correct=(bin_correct * tok).sum(), n_tok=tok.sum(),
               clm_nll=(clm_nll * w).sum(), clm_correct=(clm_correct * w).sum(),
               n_replaced=(replaced_at * w).sum())
    if scl_q is not None:
        nll, correct = nt_xent_per_view(scl_q, scl_k, temperature, scl_groups)
        out.update(scl_nll=nll.sum(), scl_correct=correct.sum(), n_view=jnp.asarray(nll.size, jnp.float32))
    return out


def coco_total(sums: Mapping[str, jax.Array], counts: Mapping[str, jax.Array],
               weights: Mapping[str, float]) -> jax.Array:
    """``mean_M CE_gen·w_gen + w_bin·L_bin + w_clm·L_clm + w_scl·L_scl`` as ``Σ w·sum/count`` with
    the counts (``n_pred``, ``n_tok``, ``n_view``) of the whole global batch."""
    total = jnp.zeros((), jnp.float32)
    for term, (num, den) in TERMS.items():
        if num in sums and weights.get(term, 0.0):
            total = total + weights[term] * sums[num] / jnp.maximum(counts[den], 1.0)
    return total


def coco_ratios(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-term mean losses and accuracies (and ``replaced_frac``) from accumulated sums."""
    return {name: sums[num] / jnp.maximum(sums[den], 1.0)
            for name, (num, den) in RATIOS.items() if num in sums}
