"""Masking statistics over many draws, and its invariants."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tacl_jax.data import synthetic
from tacl_jax.objectives import mask_tokens, num_predictions

SPECIAL = dict(pad=0, unk=1, cls=2, sep=3, mask=4)
SPECIAL_IDS = tuple(SPECIAL.values())
VOCAB = 300


def _batch(seed=0, b=64, length=48):
    return synthetic.global_batch(seed, 0, b, max_len=length, vocab_size=VOCAB, first_regular_id=5,
                                  cls_id=2, sep_id=3, pad_id=0, short_seq_prob=0.5)


@functools.lru_cache(maxsize=None)
def _mask_fn(length, whole_word, p):
    return jax.jit(lambda r, ids, am, ws: mask_tokens(
        r, ids, am, max_predictions=p or num_predictions(length), mask_id=SPECIAL["mask"], vocab_size=VOCAB,
        special_ids=SPECIAL_IDS, word_starts=ws if whole_word else None))


def _mask(batch, seed, whole_word=False, p=None):
    fn = _mask_fn(batch["input_ids"].shape[1], whole_word, p)
    return jax.device_get(fn(jax.random.key(seed), jnp.asarray(batch["input_ids"]),
                             jnp.asarray(batch["attention_mask"]), jnp.asarray(batch["word_starts"])))


def test_count_rule_positions_and_never_specials():
    batch = _batch()
    ids, am = batch["input_ids"], batch["attention_mask"]
    m = _mask(batch, 0)
    n = am.sum(1)
    expected = np.minimum(num_predictions(ids.shape[1]), np.maximum(1, np.round(0.15 * n)))
    np.testing.assert_array_equal(m.selected.sum(1), expected)       # the original's count rule
    np.testing.assert_array_equal(m.weights.sum(1), expected)
    assert not np.any(m.selected & np.isin(ids, SPECIAL_IDS))        # no [CLS]/[SEP]/[PAD]
    assert not np.any(m.selected & (am == 0))
    for b in range(ids.shape[0]):                                    # slots = sorted selected positions
        pos = np.nonzero(m.selected[b])[0]
        k = len(pos)
        np.testing.assert_array_equal(m.positions[b, :k], pos)
        np.testing.assert_array_equal(m.targets[b, :k], ids[b, pos])
        assert np.all(m.weights[b, k:] == 0)
    # Unselected tokens are untouched.
    np.testing.assert_array_equal(m.input_ids[m.selected == 0], ids[m.selected == 0])


def test_80_10_10_split_and_uniform_selection_over_many_draws():
    batch = _batch(b=128)
    ids = batch["input_ids"]
    n_mask = n_rand = n_keep = 0
    hits = np.zeros(ids.shape, np.int64)
    draws = 40
    for s in range(draws):
        m = _mask(batch, s)
        sel = m.selected.astype(bool)
        out, orig = m.input_ids[sel], ids[sel]
        n_mask += np.sum(out == SPECIAL["mask"])
        n_keep += np.sum(out == orig)
        rand = (out != SPECIAL["mask"]) & (out != orig)
        n_rand += np.sum(rand)
        assert not np.any(np.isin(out[rand], SPECIAL_IDS))   # random replacements are regular tokens
        hits += sel
    total = n_mask + n_rand + n_keep
    assert abs(n_mask / total - 0.8) < 0.01
    # "random" that happens to draw the original token counts as kept (p = 1/295, negligible)
    assert abs(n_rand / total - 0.1) < 0.01
    assert abs(n_keep / total - 0.1) < 0.01
    cand = (batch["attention_mask"] > 0) & ~np.isin(ids, SPECIAL_IDS)
    frac = hits[cand].sum() / (cand.sum() * draws)
    ratio = hits.sum() / (batch["attention_mask"].sum() * draws)
    assert abs(ratio - 0.15) < 0.01                               # 15% of the real tokens
    # every candidate position is selected at about the same rate within a row (uniform subset)
    row = 0
    rates = hits[row][cand[row]] / draws
    assert rates.std() < 0.12 and abs(rates.mean() - frac) < 0.1


def test_whole_word_masking_selects_whole_words():
    batch = _batch(b=32)
    ids, ws = batch["input_ids"], batch["word_starts"]
    cand = (batch["attention_mask"] > 0) & ~np.isin(ids, SPECIAL_IDS)
    for s in range(5):
        m = _mask(batch, s, whole_word=True)
        sel = m.selected.astype(bool)
        assert not np.any(sel & ~cand)
        n = batch["attention_mask"].sum(1)
        k = np.minimum(num_predictions(ids.shape[1]), np.maximum(1, np.round(0.15 * n)))
        assert np.all(sel.sum(1) <= k)
        assert np.mean(sel.sum(1) >= k - 3) > 0.9      # BERT's rule fills the budget nearly always
        for b in range(ids.shape[0]):
            word = -1
            words = {}
            for i in range(ids.shape[1]):
                if not cand[b, i]:
                    continue
                if ws[b, i]:
                    word = i
                words.setdefault(word, []).append(sel[b, i])
            for w, flags in words.items():
                assert all(flags) or not any(flags), f"word at {w} partly masked"


def test_masking_is_a_pure_function_of_the_key():
    batch = _batch(b=8)
    a, b, c = _mask(batch, 7), _mask(batch, 7), _mask(batch, 8)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    assert not np.array_equal(a.selected, c.selected)
