"""Per-layer geometry of a student beside its frozen teacher: what bench/tacl_effect.py measures.

``tacl_jax.analyze`` has the paper's statistic (layer-wise self-similarity of plain sentences).
To find out *why* TaCL moves it, the effect study also needs, per layer ``l`` (0 = embeddings):

* ``self_similarity``: the paper's micro-averaged pair cosine on plain ``[CLS] text [SEP]``;
* ``masked_anchor_self_similarity``: the same statistic over the pairs of *anchors* only, on the
  masked input the student is trained on (BERT's 15% with 80/10/10, a fixed mask key): the
  states TaCL's loss actually acts on;
* ``top_pc_share``: the share of the (centred) variance of the L2-normalised token states along
  their top principal direction; a common direction shared by all tokens shows here as well as
  in the self-similarity, a few rogue dimensions only here;
* ``mean_norm_sq``: ``|mean of the unit token states|²``: the all-pairs cosine including
  pairs across sentences (self-similarity is within sentences);
* ``cosine_to_teacher``: mean cosine of the student's state and the teacher's at the same token
  (plain input both), and ``anchor_cosine_to_teacher``: the student's state on the masked input at
  an anchor vs the teacher's on the plain input (the positive pair of TaCL's loss);
* last layer only, TaCL's loss at the anchors (τ = ``Masking.temperature``) as trained
  (``anchor_tacl_loss``) and with the student's common direction removed from its anchor states
  (``anchor_tacl_loss_decommon``: the component along the mean unit state of the batch's plain
  tokens projected out, then re-normalised; the direction is each batch's own). Softmax logits are shift-invariant, so a direction
  shared by all tokens changes TaCL's scores only by shrinking the rest of the unit vector: it
  lowers the effective scale 1/τ. If the loss gets *worse* without it, the common direction is
  there to soften an over-confident τ. Both are also given for a grid of temperatures
  (``TAU_GRID``: ``anchor_tacl_loss_by_tau``, ``anchor_tacl_loss_decommon_by_tau``): if the states
  without their common direction reach the same loss at a higher τ, the direction's only role is
  the temperature.

Everything is accumulated as float64 sums over batches on the host (:class:`Sums`) and divided
at the end (:func:`finish`), so the numbers do not depend on the batching.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tacl_jax.analyze import _batches, pair_cosine_sums, unit
from tacl_jax.objectives import token_contrastive_at


TAU_GRID = (0.01, 0.02, 0.05, 0.1, 0.2)


def _anchor_nll(um: jax.Array, ut: jax.Array, m: jax.Array, a: jax.Array, temperature) -> jax.Array:
    """Σ over anchors of TaCL's loss (``objectives.token_contrastive_at``, every position a slot):
    ``um``/``ut [B, L, H]`` student/teacher states, ``m`` key mask, ``a`` anchors (``[B, L]``);
    ``temperature`` a float (-> scalar) or a tuple of ``T`` (-> ``[T]``)."""
    every = jnp.broadcast_to(jnp.arange(um.shape[1], dtype=jnp.int32), um.shape[:2])

    def one(t):
        return jnp.sum(token_contrastive_at(um, ut, every, m, t)[0] * a)
    if isinstance(temperature, (tuple, list)):
        return jnp.stack([one(t) for t in temperature])
    return one(temperature)


def batch_sums(student_states: Sequence[jax.Array], masked_states: Sequence[jax.Array],
               teacher_states: Sequence[jax.Array], attention_mask: jax.Array, anchors: jax.Array,
               temperature: float = 0.01) -> dict:
    """Per-layer sums of one batch (pure; stacked over layers ``[N+1, ...]``).

    ``student_states``/``teacher_states``: per layer ``[B, L, H]`` on the plain input;
    ``masked_states``: the student's per layer on the masked input; ``attention_mask [B, L]``;
    ``anchors [B, L]`` 1 at the masked (selected) positions. Keys: ``pair_sum``/``pair_count``
    (plain), ``anchor_pair_sum``/``anchor_pair_count``, ``unit_sum [N+1, H]``, ``unit_outer
    [N+1, H, H]``, ``tokens``, ``teacher_cos_sum``, ``anchor_teacher_cos_sum``, ``anchor_count``,
    and for the last layer ``anchor_nll_sum``, ``anchor_nll_decommon_sum`` (scalars).
    """
    m = attention_mask.astype(jnp.float32)
    a = anchors.astype(jnp.float32) * m
    hi = jax.lax.Precision.HIGHEST
    out = {k: [] for k in ("pair_sum", "pair_count", "anchor_pair_sum", "anchor_pair_count", "unit_sum",
                           "unit_outer", "teacher_cos_sum", "anchor_teacher_cos_sum")}
    for hs, hm, ht in zip(student_states, masked_states, teacher_states):
        s, c = pair_cosine_sums(hs, m)
        out["pair_sum"].append(s)
        out["pair_count"].append(c)
        s, c = pair_cosine_sums(hm, a)
        out["anchor_pair_sum"].append(s)
        out["anchor_pair_count"].append(c)
        us, ut, um = unit(hs), unit(ht), unit(hm)
        w = us * m[..., None]
        out["unit_sum"].append(w.sum((0, 1)))
        out["unit_outer"].append(jnp.einsum("bld,ble->de", w, us, precision=hi))
        out["teacher_cos_sum"].append(jnp.sum(jnp.sum(us * ut, -1) * m))
        out["anchor_teacher_cos_sum"].append(jnp.sum(jnp.sum(um * ut, -1) * a))
    res = {k: jnp.stack(v) for k, v in out.items()}
    common = unit(out["unit_sum"][-1])                                        # [H]
    um_last, ut_last = unit(masked_states[-1]), unit(teacher_states[-1])
    decommon = unit(um_last - jnp.sum(um_last * common, -1, keepdims=True) * common)
    res["anchor_nll_sum"] = _anchor_nll(um_last, ut_last, m, a, temperature)
    res["anchor_nll_decommon_sum"] = _anchor_nll(decommon, ut_last, m, a, temperature)
    res["anchor_nll_grid_sum"] = _anchor_nll(um_last, ut_last, m, a, TAU_GRID)
    res["anchor_nll_decommon_grid_sum"] = _anchor_nll(decommon, ut_last, m, a, TAU_GRID)
    res["tokens"] = m.sum()
    res["anchor_count"] = a.sum()
    return res


def finish(sums: dict) -> dict[str, list[float]]:
    """Host float64 ``sums`` (added over batches) -> per-layer measures (lists over layers 0..N)."""
    n = float(sums["tokens"])
    mean = sums["unit_sum"] / n                                               # [N+1, H]
    cov = sums["unit_outer"] / n - mean[:, :, None] * mean[:, None, :]        # centred second moment
    top = [float(np.linalg.eigvalsh(c)[-1] / max(np.trace(c), 1e-30)) for c in cov]
    return dict(
        self_similarity=list(sums["pair_sum"] / np.maximum(sums["pair_count"], 1.0)),
        masked_anchor_self_similarity=list(sums["anchor_pair_sum"] / np.maximum(sums["anchor_pair_count"], 1.0)),
        top_pc_share=top,
        mean_norm_sq=list(np.sum(mean * mean, axis=-1)),
        cosine_to_teacher=list(sums["teacher_cos_sum"] / n),
        anchor_cosine_to_teacher=list(sums["anchor_teacher_cos_sum"] / max(float(sums["anchor_count"]), 1.0)),
        anchor_tacl_loss=float(sums["anchor_nll_sum"] / max(float(sums["anchor_count"]), 1.0)),
        anchor_tacl_loss_decommon=float(sums["anchor_nll_decommon_sum"] / max(float(sums["anchor_count"]), 1.0)),
        anchor_tacl_loss_by_tau=list(sums["anchor_nll_grid_sum"] / max(float(sums["anchor_count"]), 1.0)),
        anchor_tacl_loss_decommon_by_tau=list(sums["anchor_nll_decommon_grid_sum"]
                                              / max(float(sums["anchor_count"]), 1.0)))


@functools.lru_cache(maxsize=8)
def _measure_fn(model, teacher_model, temperature: float):
    def fn(params, teacher_params, ids, mask, masked_ids, anchors):
        tt = jnp.zeros_like(ids)

        def states(m, p, x):
            return m.apply({"params": p}, x, mask, tt, deterministic=True, output_hidden_states=True,
                           heads=False).hidden_states
        return batch_sums(states(model, params, ids), states(model, params, masked_ids),
                          states(teacher_model, teacher_params, ids), mask, anchors, temperature)
    return jax.jit(fn)


@dataclasses.dataclass(frozen=True)
class Masking:
    """How the anchors are drawn for ``masked_anchor_*`` (the training recipe's numbers)."""
    mask_id: int
    special_ids: tuple[int, ...]
    vocab_size: int
    mask_prob: float = 0.15
    seed: int = 1234
    temperature: float = 0.01      # of anchor_tacl_loss*


def measure(model, params, teacher_model, teacher_params, ids: list[np.ndarray], masking: Masking,
            batch_size: int = 32) -> dict[str, list[float]]:
    """All measures (module doc) of ``model``/``params`` beside the teacher on sentences ``ids``
    (``[CLS] ... [SEP]`` id arrays, as ``analyze.encode_sentences`` gives). Batches are masked with
    a key folded from ``masking.seed`` and the batch index: the same anchors for every model."""
    from tacl_jax.objectives import mask_tokens, num_predictions

    fn = _measure_fn(model, teacher_model, masking.temperature)
    total = None
    for i, (x, m) in enumerate(_batches(ids, batch_size, model.config.pad_token_id)):
        masked = mask_tokens(jax.random.fold_in(jax.random.key(masking.seed), i), jnp.asarray(x), jnp.asarray(m),
                             max_predictions=num_predictions(x.shape[1], masking.mask_prob), mask_id=masking.mask_id,
                             vocab_size=masking.vocab_size, special_ids=masking.special_ids,
                             mask_prob=masking.mask_prob)
        s = jax.device_get(fn(params, teacher_params, x, m, masked.input_ids, masked.selected))
        s = {k: np.asarray(v, np.float64) for k, v in s.items()}
        total = s if total is None else {k: total[k] + s[k] for k in total}
    return finish(total)
