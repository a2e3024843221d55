"""The combined pre-training objective: ``w_mlm·L_mlm + w_tacl·L_tacl (+ w_nsp·L_nsp)``.

Everything is kept as *sums* plus their counts so that gradient accumulation can divide by the
count of the whole global batch: k micro-batches then give exactly the gradient of one batch of
k·b, whatever the number of masked tokens in each micro-batch (weighting by token count).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from tacl_jax.objectives.contrastive import token_contrastive_at
from tacl_jax.objectives.masking import Masked
from tacl_jax.objectives.mlm import mlm_per_position

# loss term (a key of loss_weights) -> (its sum, the batch count it is divided by)
TERMS = {"mlm": ("mlm_nll", "n_pred"), "tacl": ("tacl_nll", "n_anchor"), "nsp": ("nsp_nll", "n_seq")}
# metric name -> (numerator sum, denominator count)
RATIOS = {"mlm_loss": ("mlm_nll", "n_pred"), "mlm_acc": ("mlm_correct", "n_pred"),
          "tacl_loss": ("tacl_nll", "n_anchor"), "tacl_acc": ("tacl_correct", "n_anchor"),
          "nsp_loss": ("nsp_nll", "n_seq"), "nsp_acc": ("nsp_correct", "n_seq")}


def objective_sums(*, mlm_logits: jax.Array | None, masked: Masked, student_hidden: jax.Array | None = None,
                   teacher_hidden: jax.Array | None = None, key_mask: jax.Array | None = None,
                   temperature: float = 0.01, nsp_logits: jax.Array | None = None,
                   nsp_labels: jax.Array | None = None, student_at_slots: bool = False,
                   anchor_mask: jax.Array | None = None) -> dict[str, jax.Array]:
    """Loss sums and counts of one (micro-)batch. Shapes: ``mlm_logits [B, P, V]`` at
    ``masked.positions``, ``teacher_hidden [B, L, H]``, ``student_hidden [B, L, H]`` or, with
    ``student_at_slots``, ``[B, P, H]`` at ``masked.positions`` (the gathered last layer); the
    anchors are the slots of weight 1 either way (the same set as ``masked.selected``), ``key_mask
    [B, L]`` or None, ``nsp_logits [B, 2]``, ``nsp_labels [B]``. Terms whose inputs are None are
    left out. ``anchor_mask [B, L]`` (config ``tacl.anchors='all'``) makes every position where it
    is 1 an anchor instead of the selected ones; ``student_hidden`` is then ``[B, L, H]``."""
    out = {}
    if mlm_logits is not None:
        nll, correct = mlm_per_position(mlm_logits, masked.targets)
        w = masked.weights
        out.update(mlm_nll=(nll * w).sum(), mlm_correct=(correct * w).sum(), n_pred=w.sum())
    if teacher_hidden is not None and anchor_mask is not None:
        every = jnp.broadcast_to(jnp.arange(student_hidden.shape[1], dtype=jnp.int32), student_hidden.shape[:2])
        nll, correct = token_contrastive_at(student_hidden, teacher_hidden, every, key_mask, temperature)
        m = anchor_mask.astype(jnp.float32)
        out.update(tacl_nll=(nll * m).sum(), tacl_correct=(correct * m).sum(), n_anchor=m.sum())
    elif teacher_hidden is not None:
        # Only the anchors' scores are needed: [B, P, L], not [B, L, L] (padding slots weigh 0).
        anchors = student_hidden if student_at_slots else jnp.take_along_axis(
            student_hidden, masked.positions[..., None].astype(jnp.int32), axis=1)
        nll, correct = token_contrastive_at(anchors, teacher_hidden, masked.positions, key_mask, temperature)
        m = masked.weights.astype(jnp.float32)
        out.update(tacl_nll=(nll * m).sum(), tacl_correct=(correct * m).sum(), n_anchor=m.sum())
    if nsp_logits is not None:
        logp = jax.nn.log_softmax(nsp_logits.astype(jnp.float32), axis=-1)
        labels = nsp_labels.astype(jnp.int32)
        out.update(nsp_nll=-jnp.take_along_axis(logp, labels[:, None], axis=-1).sum(),
                   nsp_correct=(jnp.argmax(logp, -1) == labels).astype(jnp.float32).sum(),
                   n_seq=jnp.asarray(labels.shape[0], jnp.float32))
    return out


def total_loss(sums: Mapping[str, jax.Array], counts: Mapping[str, jax.Array],
               weights: Mapping[str, float]) -> jax.Array:
    """``Σ_term w_term · sum_term / count_term`` with ``counts`` those of the whole global batch
    (``n_pred``, ``n_anchor``, ``n_seq``); ``weights`` keys: ``mlm``, ``tacl``, ``nsp``."""
    return weighted_total(sums, counts, weights, TERMS)


def ratios(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-term mean losses and accuracies from accumulated sums."""
    return ratios_of(sums, RATIOS)


def weighted_total(sums: Mapping[str, jax.Array], counts: Mapping[str, jax.Array], weights: Mapping[str, float],
                   terms: Mapping[str, tuple[str, str]]) -> jax.Array:
    """``Σ_term weights[term] · sums[num] / counts[den]`` over ``terms`` (``term -> (num, den)``) whose
    sum is present and weight non-zero; a zero count divides by 1 (its sum is 0 too)."""
    total = jnp.zeros((), jnp.float32)
    for term, (num, den) in terms.items():
        if num in sums and weights.get(term, 0.0):
            total = total + weights[term] * sums[num] / jnp.maximum(counts[den], 1.0)
    return total


def ratios_of(sums: Mapping[str, jax.Array], table: Mapping[str, tuple[str, str]]) -> dict[str, jax.Array]:
    """``{name: sums[num] / sums[den]}`` for ``table``'s ``name -> (num, den)`` present in ``sums``."""
    return {name: sums[num] / jnp.maximum(sums[den], 1.0) for name, (num, den) in table.items() if num in sums}
