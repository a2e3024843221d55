"""BERT's dynamic 80/10/10 masking, on device, with static shapes.

Pure function of ``(rng, batch)``; the train step calls it inside ``jit`` with an RNG folded with
the step number, so every step draws a fresh mask (dynamic masking) and a resumed run redraws the
same one.

How many positions a row selects (``budget``, config ``masking.budget``; :func:`selection_count`):

* ``'bert'`` (default; Google BERT's ``create_masked_lm_predictions``): ``k = min(max_predictions,
  max(1, round(mask_prob · n)))`` sub-tokens, ``n`` the real (unpadded) tokens of the row
  *including* [CLS]/[SEP]. Sub-word masking draws exactly ``k`` positions without replacement among
  the candidates (real tokens that are not special). Whole-word masking visits the words in random
  order and takes a word unless it would push the sub-token count past ``k`` (so a row selects at
  most ``k`` sub-tokens, nearly always close to ``k``).
* ``'tacl'`` (the TaCL authors' ``pretraining/dataclass_english.py``): sub-word masking draws
  ``k = min(int(0.25 · max_len), max(1, round(mask_prob · n)))`` sub-tokens (the same ``k`` as
  ``'bert'`` whenever ``max_predictions <= 0.25 · max_len``, which the default slots are); whole-word
  masking draws exactly ``k_w = min(int(0.25 · w), max(1, round(mask_prob · w)))`` whole words, ``w``
  the row's candidate words, and selects every sub-token of them however many that is (so a row
  of fewer than 4 words selects nothing, as the original). Slots are static, so a word whose
  sub-tokens would overflow the ``max_predictions`` slots is skipped and the next one taken
  (:func:`num_predictions` gives this rule ``int(0.25 · max_len)`` slots: to overflow them the
  drawn words would have to average about 1.7 times the row's sub-tokens per word).
* ``'bernoulli'`` (Hugging Face's ``DataCollatorForLanguageModeling``; the effect study's PyTorch
  peer, ``bench/torch_peer.py``): every candidate sub-token selected independently with
  probability ``mask_prob``, so the count varies from row to row (Binomial, mean ``mask_prob`` ·
  candidates) where the other rules fix it. Sub-words only. Slots are static, so a row that draws
  more than ``max_predictions`` keeps a uniform subset of that many; :func:`num_predictions` gives
  this rule enough slots that a row of ``max_len`` candidates overflows them with probability
  ≤ 1e-6 (41 slots at 128 tokens where 'bert' has 19: a larger MLM-head matmul is the price;
  ``configs/base.py`` compiled for a v4-8: 68 slots, +0.55 GiB peak, +2.8% estimated step).

The counts are table look-ups computed with Python's float64 ``round`` (half to even), so ``k(n)``
is the original's bit for bit (float32 ``round(0.15 · 190)`` is 29, Python's is 28).

A word is a candidate whose ``word_starts`` is 1, or whose predecessor is not a candidate (a piece
that a row boundary or a special token cut off from its word's start), with the candidates after it
whose ``word_starts`` is 0. Every sequence has ``max_predictions`` prediction slots so shapes are
static; slots beyond the selection have weight 0. 80/10/10 is decided per sub-token.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

BUDGETS = ("bert", "tacl", "bernoulli")
TACL_CAP = 0.25    # the TaCL authors' cap: max_len · 0.25 sub-tokens, int(0.25 · w) whole words
BERNOULLI_OVERFLOW = 1e-6    # 'bernoulli': the chance that a full row draws more than its slots


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


def num_predictions(max_len: int, mask_prob: float = 0.15, *, budget: str = "bert",
                    whole_word: bool = False) -> int:
    """Static number of prediction slots for sequences of ``max_len``: never truncates the count
    rule, since n ≤ max_len; with ``budget='tacl'`` and whole words, ``int(0.25 · max_len)`` if more
    (the whole words' sub-tokens are not bounded by the count); with ``'bernoulli'`` the smallest
    ``k`` with P(Binomial(max_len, mask_prob) > k) ≤ 1e-6."""
    if budget == "bernoulli":
        return min(_binomial_quantile(int(max_len), float(mask_prob), BERNOULLI_OVERFLOW), max_len)
    slots = max(1, int(round(mask_prob * max_len)))
    if budget == "tacl" and whole_word:
        slots = max(slots, int(max_len * TACL_CAP))
    return min(slots, max_len)


def _binomial_quantile(n: int, p: float, tail: float) -> int:
    """The smallest ``k ≥ 1`` with P(Binomial(n, p) > k) ≤ ``tail`` (float64 sum of the pmf, each
    term in log space: ``math.comb(n, k)`` overflows a float from n ≈ 2,000)."""
    cdf = 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    for k in range(n + 1):
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p
                        + (n - k) * log_q)
        if 1.0 - cdf <= tail:
            return max(1, k)
    return n


@functools.lru_cache(maxsize=64)
def _count_table(max_len: int, mask_prob: float, budget: str, words: bool) -> np.ndarray:
    if budget not in BUDGETS:
        raise ValueError(f"masking budget {budget!r}: use one of {BUDGETS}")
    if budget == "bernoulli":
        raise ValueError("the 'bernoulli' rule has no count table: each candidate is drawn on its own (mask_tokens)")
    if words and budget != "tacl":
        raise ValueError("a budget in words is the 'tacl' rule's (BERT's whole words spend a sub-token budget)")
    table = []
    for n in range(max_len + 1):
        k = max(1, int(round(n * mask_prob)))
        if budget == "tacl":
            k = min(int(n * TACL_CAP) if words else int(max_len * TACL_CAP), k)
        table.append(k)
    return np.asarray(table, np.int32)


def selection_count(n: jax.Array, *, max_len: int, mask_prob: float = 0.15, budget: str = "bert",
                    words: bool = False) -> jax.Array:
    """How many units a row selects, before the slot cap. ``n``: int ``[...]`` (any shape), the
    row's real tokens including [CLS]/[SEP] (``words=False``) or its candidate words
    (``words=True``, ``budget='tacl'`` only); returns int32 ``[...]``:

    * ``'bert'``: ``max(1, round(mask_prob · n))``;
    * ``'tacl'``: ``min(int(0.25 · max_len), max(1, round(mask_prob · n)))`` sub-tokens, or with
      ``words`` ``min(int(0.25 · n), max(1, round(mask_prob · n)))`` words.

    A gather from a static ``[max_len + 1]`` table built with Python floats (jit-friendly; ``n`` is
    clipped to ``[0, max_len]``). A row with no candidates still gets a count ≥ 1 here; the
    selection itself never exceeds the candidates.
    """
    table = jnp.asarray(_count_table(int(max_len), float(mask_prob), budget, bool(words)))
    return table[jnp.clip(n, 0, max_len).astype(jnp.int32)]


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
                word_starts: jax.Array | None = None, budget: str = "bert") -> Masked:
    """Select and corrupt tokens. ``input_ids``, ``attention_mask``, ``word_starts``: ``[B, L]``;
    the result's ``[B, P]`` fields have ``P = max_predictions``.

    ``special_ids`` are never selected (pass [CLS], [SEP], [PAD], [UNK], [MASK]); padding
    (``attention_mask == 0``) never either. ``budget``: ``'bert'`` | ``'tacl'``, the count rule
    (module docstring), or ``'bernoulli'`` (sub-words only). Random replacements are uniform over
    the non-special vocabulary.
    """
    if budget == "bernoulli" and word_starts is not None:
        raise ValueError("masking budget 'bernoulli' draws sub-tokens one by one: whole-word masking needs "
                         "budget 'bert' or 'tacl'")
    b, length = input_ids.shape
    p = max_predictions
    k_sel, k_what, k_rand = jax.random.split(rng, 3)
    real = attention_mask > 0
    candidate = real & ~jnp.isin(input_ids, jnp.asarray(list(special_ids), input_ids.dtype))
    n_real = real.sum(-1)
    score = jax.random.uniform(k_sel, (b, length))

    if word_starts is None:
        if budget == "bernoulli":   # score ≥ 1 − mask_prob has probability mask_prob, per candidate
            count = (candidate & (score >= 1.0 - mask_prob)).sum(-1)
        else:
            count = selection_count(n_real, max_len=length, mask_prob=mask_prob, budget=budget)
        count = jnp.minimum(jnp.minimum(count, p), candidate.sum(-1))  # only specials: nothing
        # The k highest random scores among the candidates are a uniform k-subset.
        ranked = jnp.where(candidate, score, -1.0)
        order = jnp.argsort(-ranked, axis=-1)                         # [B, L], best first
        rank = jnp.argsort(order, axis=-1)                            # rank of each position
        selected = candidate & (rank < count[:, None])
    else:
        after_candidate = jnp.pad(candidate[:, :-1], ((0, 0), (1, 0)))
        starts = candidate & ((word_starts > 0) | ~after_candidate)
        # Word id of each candidate: index of the latest word start at or before it.
        word_of = jnp.maximum(jax.lax.cummax(jnp.where(starts, jnp.arange(length)[None], -1), axis=1), 0)
        wscore = jnp.where(starts, score, -1.0)                       # one score per word (at its start)
        order = jnp.argsort(-wscore, axis=-1)                         # words best first (start positions)
        word_rank = jnp.argsort(order, axis=-1)                       # rank of each word start
        size = jnp.zeros((b, length), jnp.int32).at[jnp.arange(b)[:, None], word_of].add(candidate.astype(jnp.int32))
        size_by_rank = jnp.take_along_axis(size, order, axis=1) * (jnp.take_along_axis(wscore, order, 1) >= 0)
        if budget == "tacl":      # k_w whole words, whatever their sub-tokens (within the P slots)
            token_cap = jnp.full((b,), p, jnp.int32)
            word_cap = selection_count(starts.sum(-1), max_len=length, mask_prob=mask_prob, budget="tacl",
                                       words=True)
        else:                     # BERT: words while the sub-tokens stay within k
            token_cap = jnp.minimum(selection_count(n_real, max_len=length, mask_prob=mask_prob, budget=budget), p)
            word_cap = jnp.full((b,), length, jnp.int32)

        # Walk the words in random order; skip one that would overshoot the sub-token cap, go on.
        def take(carry, s):
            total, words = carry
            ok = (s > 0) & (total + s <= token_cap) & (words < word_cap)
            return (total + jnp.where(ok, s, 0), words + ok), ok

        zeros = jnp.zeros((b,), jnp.int32)
        _, taken_by_rank = jax.lax.scan(take, (zeros, zeros), size_by_rank.T)
        taken_word = jnp.take_along_axis(taken_by_rank.T, word_rank, axis=1) & starts
        selected = candidate & jnp.take_along_axis(taken_word, word_of, axis=1)

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
