"""BERT's dynamic 80/10/10 masking, on device, with static shapes.

Pure function of ``(rng, batch)``; the train step calls it inside ``jit`` with an RNG folded with
the step number, so every step draws a fresh mask (dynamic masking) and a resumed run redraws the
same one.

Count rule of the original TaCL code: ``k = min(max_predictions, max(1, round(0.15 · n)))`` where
``n`` counts the real (unpadded) tokens of the sequence *including* [CLS]/[SEP], as the original
does; rounding is half-to-even like Python's ``round``. Exactly ``k`` positions are drawn without
replacement among the candidates (real tokens that are not special). Every sequence has
``max_predictions`` prediction slots so shapes are static; slots beyond ``k`` have weight 0.

Whole-word masking (when ``word_starts`` is given): words are visited in random order and a word
is taken unless it would push the sub-token count past k (BERT's ``create_masked_lm_predictions``
rule); 80/10/10 is decided per sub-token.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Masked:
    """``input_ids [B, L]`` (the student's input), ``selected [B, L]`` (1 at every predicted
    position, whatever its 80/10/10 outcome), ``positions [B, P]`` (predicted positions in
    ascending order, padded with 0), ``targets [B, P]`` (original ids there), ``weights [B, P]``
    (1.0 for real slots, 0.0 for padding slots)."""

    input_ids: jax.Array
    selected: jax.Array
    positions: jax.Array
    targets: jax.Array
    weights: jax.Array


def num_predictions(max_len: int, mask_prob: float = 0.15) -> int:
    """Static number of prediction slots for sequences of ``max_len``: never truncates the count
    rule, since n ≤ max_len."""
    return max(1, int(round(mask_prob * max_len)))


def _random_regular_token(rng, shape, vocab_size: int, special_ids: Sequence[int]) -> jax.Array:
    """Uniform over ``[0, vocab_size)`` minus ``special_ids``: draw from the smaller range, then
    step over each special id at or below the draw."""
    specials = sorted({int(s) for s in special_ids if 0 <= int(s) < vocab_size})
    r = jax.random.randint(rng, shape, 0, vocab_size - len(specials))
    for s in specials:
        r = r + (r >= s)
    return r


def mask_tokens(rng: jax.Array, input_ids: jax.Array, attention_mask: jax.Array, *,
                max_predictions: int, mask_id: int, vocab_size: int, special_ids: Sequence[int],
                mask_prob: float = 0.15, replace_prob: float = 0.8, random_prob: float = 0.1,
                word_starts: jax.Array | None = None) -> Masked:
    """Select and corrupt tokens. ``input_ids``, ``attention_mask``, ``word_starts``: ``[B, L]``.

    ``special_ids`` are never selected (pass [CLS], [SEP], [PAD], [UNK], [MASK]); padding
    (``attention_mask == 0``) never either. Random replacements are uniform over the non-special
    vocabulary.
    """
    b, length = input_ids.shape
    p = max_predictions
    k_sel, k_what, k_rand = jax.random.split(rng, 3)
    real = attention_mask > 0
    candidate = real & ~jnp.isin(input_ids, jnp.asarray(list(special_ids), input_ids.dtype))
    n_real = real.sum(-1)
    count = jnp.minimum(p, jnp.maximum(1, jnp.round(mask_prob * n_real).astype(jnp.int32)))
    count = jnp.minimum(count, candidate.sum(-1))  # a sequence of only specials selects nothing
    score = jax.random.uniform(k_sel, (b, length))

    if word_starts is None:
        # The k highest random scores among the candidates are a uniform k-subset.
        ranked = jnp.where(candidate, score, -1.0)
        order = jnp.argsort(-ranked, axis=-1)                         # [B, L], best first
        rank = jnp.argsort(order, axis=-1)                            # rank of each position
        selected = candidate & (rank < count[:, None])
    else:
        starts = (word_starts > 0) & candidate
        # Word id of each token: index of the latest word start at or before it.
        word_of = jax.lax.cummax(jnp.where(starts, jnp.arange(length)[None], -1), axis=1)
        in_word = candidate & (word_of >= 0)
        word_of = jnp.maximum(word_of, 0)
        wscore = jnp.where(starts, score, -1.0)                       # one score per word (at its start)
        order = jnp.argsort(-wscore, axis=-1)                         # words best first (start positions)
        word_rank = jnp.argsort(order, axis=-1)                       # rank of each word start
        # Sub-tokens per word, accumulated in rank order: a word is taken while the total ≤ k.
        size = jnp.zeros((b, length), jnp.int32).at[jnp.arange(b)[:, None], word_of].add(in_word.astype(jnp.int32))
        size_by_rank = jnp.take_along_axis(size, order, axis=1) * (jnp.take_along_axis(wscore, order, 1) >= 0)
        # BERT's rule: walk the words in random order, skip one that would overshoot k, go on.
        def take(total, s):
            ok = (s > 0) & (total + s <= count)
            return total + jnp.where(ok, s, 0), ok

        _, taken_by_rank = jax.lax.scan(take, jnp.zeros((b,), jnp.int32), size_by_rank.T)
        taken_by_rank = taken_by_rank.T
        taken_word = jnp.take_along_axis(taken_by_rank, word_rank, axis=1) & starts
        selected = in_word & jnp.take_along_axis(taken_word, word_of, axis=1)

    # Ascending positions of the selected tokens in the P slots (unselected score below 0).
    key = jnp.where(selected, length - jnp.arange(length)[None], -1)
    top, _ = jax.lax.top_k(key, p)
    weights = (top > 0).astype(jnp.float32)
    positions = jnp.where(top > 0, length - top, 0).astype(jnp.int32)
    targets = jnp.take_along_axis(input_ids, positions, axis=1)

    u = jax.random.uniform(k_what, (b, length))
    random_tok = _random_regular_token(k_rand, (b, length), vocab_size, special_ids).astype(input_ids.dtype)
    corrupted = jnp.where(u < replace_prob, jnp.asarray(mask_id, input_ids.dtype),
                          jnp.where(u < replace_prob + random_prob, random_tok, input_ids))
    masked_ids = jnp.where(selected, corrupted, input_ids)
    return Masked(input_ids=masked_ids, selected=selected.astype(jnp.int32), positions=positions,
                  targets=targets, weights=weights)
