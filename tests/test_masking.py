"""Masking statistics over many draws, and its invariants."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tacl_jax.data import synthetic
from tacl_jax.objectives import mask_tokens, num_predictions, selection_count

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


def _tally(m, ids):
    """``(→ [MASK], unchanged, → random)`` counts among the selected positions of ``m``; asserts
    the random replacements are regular tokens."""
    sel = np.asarray(m.selected).astype(bool)
    out, orig = np.asarray(m.input_ids)[sel], ids[sel]
    rand = (out != SPECIAL["mask"]) & (out != orig)
    assert not np.any(np.isin(out[rand], SPECIAL_IDS))   # random replacements are regular tokens
    return np.sum(out == SPECIAL["mask"]), np.sum(out == orig), np.sum(rand)


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
        k_mask, k_keep, k_rand = _tally(m, ids)
        n_mask, n_keep, n_rand = n_mask + k_mask, n_keep + k_keep, n_rand + k_rand
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


# ----------------------------------------------------------------------------- masking.budget

def _original_count(n, *, budget, words=False, max_len, mask_prob=0.15):
    """The count rules as the authors' Python writes them (dataclass_english.py; BERT's
    create_masked_lm_predictions for 'bert')."""
    k = max(1, int(round(n * mask_prob)))
    if budget == "bert":
        return k
    if words:                                       # whole_word_random_mask
        return min(int(n * 0.25), k)
    return int(min(max_len * 0.25, k))              # random_mask(tokens, 0.15, self.max_len * 0.25)


@pytest.mark.parametrize("budget,words", [("bert", False), ("tacl", False), ("tacl", True)])
@pytest.mark.parametrize("max_len,mask_prob", [(32, 0.15), (256, 0.15), (512, 0.15), (128, 0.4)])
def test_selection_count_is_the_originals_rule_for_every_n(budget, words, max_len, mask_prob):
    n = np.arange(max_len + 1)
    got = np.asarray(jax.jit(lambda x: selection_count(x, max_len=max_len, mask_prob=mask_prob, budget=budget,
                                                        words=words))(jnp.asarray(n)))
    want = [_original_count(int(i), budget=budget, words=words, max_len=max_len, mask_prob=mask_prob) for i in n]
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32
    if max_len == 256 and mask_prob == 0.15 and not words:
        assert got[190] == 28            # Python's round(28.499999999999996); float32 would give 29


def test_selection_count_refuses_unknown_budgets_and_bert_words():
    with pytest.raises(ValueError, match="use one of"):
        selection_count(jnp.arange(3), max_len=8, budget="original")
    with pytest.raises(ValueError, match="'tacl' rule"):
        selection_count(jnp.arange(3), max_len=8, budget="bert", words=True)


def _rows(lengths, length, seed=0, p_start=0.7):
    """Rows ``[CLS] a [SEP] b [SEP] [PAD]...`` with some [UNK] inside and word starts drawn at every
    position, so some rows start a segment with a continuation piece (cut off from its word)."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    ids = rng.integers(5, VOCAB, (b, length)).astype(np.int32)
    am = np.zeros((b, length), np.int32)
    for r, n in enumerate(lengths):
        am[r, :n] = 1
        ids[r, n:] = SPECIAL["pad"]
        ids[r, 0], ids[r, n - 1] = SPECIAL["cls"], SPECIAL["sep"]
        if n >= 5:
            ids[r, n // 2] = SPECIAL["sep"]
        unk = rng.random(n) < 0.03
        unk[[0, n - 1]] = False
        ids[r, :n][unk] = SPECIAL["unk"]
    ws = (rng.random((b, length)) < p_start).astype(np.int32)
    return dict(input_ids=ids, attention_mask=am, word_starts=ws)


def _ref_words(ids, am, ws):
    """The words of one row, naively: a candidate starts a word if it is marked so or follows a
    non-candidate; later candidates not marked continue it."""
    cand = (am > 0) & ~np.isin(ids, SPECIAL_IDS)
    words = []
    for i in range(len(ids)):
        if not cand[i]:
            continue
        if ws[i] or i == 0 or not cand[i - 1]:
            words.append([i])
        else:
            words[-1].append(i)
    return words


@functools.lru_cache(maxsize=None)
def _budget_fn(whole_word, budget, p):
    return jax.jit(lambda r, ids, am, ws: mask_tokens(
        r, ids, am, max_predictions=p, mask_id=SPECIAL["mask"], vocab_size=VOCAB, special_ids=SPECIAL_IDS,
        word_starts=ws if whole_word else None, budget=budget))


def _mask_budget(batch, seed, *, whole_word, budget, p):
    fn = _budget_fn(whole_word, budget, p)
    return jax.device_get(fn(jax.random.key(seed), *(jnp.asarray(batch[k]) for k in
                                                     ("input_ids", "attention_mask", "word_starts"))))


def _check_slots(m, ids):
    sel = m.selected.astype(bool)
    assert not np.any(sel & np.isin(ids, SPECIAL_IDS))
    for r in range(ids.shape[0]):
        pos = np.nonzero(sel[r])[0]
        np.testing.assert_array_equal(m.positions[r, :len(pos)], pos)
        np.testing.assert_array_equal(m.targets[r, :len(pos)], ids[r, pos])
        assert m.weights[r].sum() == len(pos) and np.all(m.weights[r, len(pos):] == 0)


@pytest.mark.parametrize("budget", ["bert", "tacl"])
def test_subword_budgets_select_exactly_the_originals_count(budget):
    length = 256
    lengths = [190, 256, 3, 2, 10, 30, 50, 70, 100, 133, 200, 255, 4, 17, 190, 64]
    batch = _rows(lengths, length, seed=1)
    ids, am = batch["input_ids"], batch["attention_mask"]
    p = num_predictions(length, budget=budget)
    assert p == 38
    cand = ((am > 0) & ~np.isin(ids, SPECIAL_IDS)).sum(1)
    want = [min(_original_count(n, budget=budget, max_len=length), p, c) for n, c in zip(lengths, cand)]
    for seed in range(3):
        m = _mask_budget(batch, seed, whole_word=False, budget=budget, p=p)
        np.testing.assert_array_equal(m.selected.sum(1), want)
        _check_slots(m, ids)
    assert want[0] == 28 and want[2] == 1 and want[3] == 0   # n=190; [CLS] x [SEP]; [CLS] [SEP]


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["bert", "tacl"])
def test_whole_word_budgets_take_whole_words_and_the_originals_word_count(budget):
    length = 64
    rng = np.random.default_rng(3)
    lengths = [int(x) for x in rng.integers(2, length + 1, 48)] + [2, 3, 5, 6, 7, 8, length, length]
    batch = _rows(lengths, length, seed=4)
    ids, am, ws = batch["input_ids"], batch["attention_mask"], batch["word_starts"]
    p = length    # slots never bind: the count rule alone decides
    for seed in range(4):
        m = _mask_budget(batch, seed, whole_word=True, budget=budget, p=p)
        sel = m.selected.astype(bool)
        _check_slots(m, ids)
        for r, n in enumerate(lengths):
            words = _ref_words(ids[r], am[r], ws[r])
            taken = [w for w in words if sel[r, w].any()]
            assert all(sel[r, w].all() for w in taken), f"row {r}: a word partly selected"
            assert sel[r].sum() == sum(len(w) for w in taken)
            if budget == "tacl":
                assert len(taken) == _original_count(len(words), budget="tacl", words=True, max_len=length)
            else:
                k = _original_count(n, budget="bert", max_len=length)
                assert sel[r].sum() <= k
                # BERT's walk skips only words that overshoot: every word left out would.
                left = [len(w) for w in words if w not in taken]
                assert all(sel[r].sum() + s > k for s in left)


def test_tacl_whole_words_skip_a_word_that_would_overflow_the_slots():
    length = 64
    ids = np.full((1, length), 7, np.int32)
    ids[0, 0], ids[0, -1] = SPECIAL["cls"], SPECIAL["sep"]
    ws = np.zeros((1, length), np.int32)
    ws[0, 1:61:5] = 1                      # 12 words of 5 pieces, then a word of 2 pieces
    ws[0, 61] = 1
    batch = dict(input_ids=ids, attention_mask=np.ones_like(ids), word_starts=ws)
    k_w = _original_count(13, budget="tacl", words=True, max_len=length)
    assert k_w == 2
    for seed in range(6):
        m = _mask_budget(batch, seed, whole_word=True, budget="tacl", p=7)
        # Whichever word comes first, a second 5-piece word would overflow the 7 slots and is
        # skipped; the 2-piece word fits: always one of each.
        sel = m.selected[0].astype(bool)
        assert sel.sum() == 7 and m.weights.sum() == 7 and sel[61:63].all()
    assert num_predictions(length, budget="tacl", whole_word=True) == 16
    assert num_predictions(length, budget="tacl") == num_predictions(length) == 10


@pytest.mark.slow
@pytest.mark.parametrize("whole_word", [False, True])
def test_tacl_budget_keeps_the_80_10_10_split(whole_word):
    batch = _rows([64] * 96 + [40] * 32, 64, seed=5)
    ids = batch["input_ids"]
    p = num_predictions(64, budget="tacl", whole_word=whole_word)
    n_mask = n_rand = n_keep = 0
    for s in range(30):
        m = _mask_budget(batch, s, whole_word=whole_word, budget="tacl", p=p)
        sel = m.selected.astype(bool)
        k_mask, k_keep, k_rand = _tally(m, ids)
        n_mask, n_keep, n_rand = n_mask + k_mask, n_keep + k_keep, n_rand + k_rand
        np.testing.assert_array_equal(m.input_ids[~sel], ids[~sel])
    total = n_mask + n_rand + n_keep
    assert total > 10_000
    assert abs(n_mask / total - 0.8) < 0.015
    assert abs(n_rand / total - 0.1) < 0.01
    assert abs(n_keep / total - 0.1) < 0.01


def test_step_config_carries_the_budget_and_its_slots():
    from tacl_jax.config import load_config_file
    from tacl_jax.train.step import step_config_from

    c = load_config_file(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py"))
    special = dict(pad=0, unk=1, cls=2, sep=3, mask=4)
    assert step_config_from(c, special).budget == "bert"
    c.masking.budget, c.masking.whole_word = "tacl", True
    sc = step_config_from(c, special)
    assert sc.budget == "tacl" and sc.max_predictions == c.max_len // 4
    c.masking.max_predictions = 12
    assert step_config_from(c, special).max_predictions == 12
    c.masking.budget, c.masking.whole_word, c.masking.max_predictions = "bernoulli", False, 0
    sc = step_config_from(c, special)
    assert sc.budget == "bernoulli" and sc.max_predictions == num_predictions(c.max_len, budget="bernoulli")


# ----------------------------------------------------------------------------- budget 'bernoulli'

def test_bernoulli_budget_draws_each_candidate_independently():
    """Hugging Face's collator (and the effect study's peer): over many draws each candidate is
    selected with probability 0.15, so a row's count is Binomial(candidates, 0.15) — its variance
    too, which a fixed-count rule (variance 0) fails — and rows with no candidates select nothing."""
    length, draws = 64, 40
    lengths = [64] * 30 + [2, 20]
    batch = _rows(lengths, length, seed=2)
    ids, am = batch["input_ids"], batch["attention_mask"]
    p = num_predictions(length, budget="bernoulli")
    cand = (am > 0) & ~np.isin(ids, SPECIAL_IDS)
    counts, hits = [], np.zeros(ids.shape)
    for seed in range(draws):
        m = _mask_budget(batch, seed, whole_word=False, budget="bernoulli", p=p)
        _check_slots(m, ids)
        assert not np.any(m.selected.astype(bool) & ~cand)
        counts.append(m.selected.sum(1))
        hits += m.selected
    counts = np.asarray(counts)                            # [draws, rows]
    assert np.all(counts[:, 30] == 0)                      # [CLS] [SEP]: no candidate
    n = cand[:30].sum(1)                                   # ~59 candidates a full row ([UNK]s vary)
    dev = (counts[:, :30] - 0.15 * n).ravel()              # 1,200 draws of count − its Binomial mean
    var = 0.15 * 0.85 * n.mean()
    assert abs(dev.mean()) < 4 * np.sqrt(var / dev.size)
    assert 0.8 * var < np.mean(dev ** 2) < 1.2 * var
    freq = hits[:30][cand[:30]] / draws                    # per position: ~0.15 everywhere
    assert abs(freq.mean() - 0.15) < 0.01 and freq.std() < 0.1
    # The 80/10/10 split is kept.
    n_mask, n_keep, n_rand = _tally(m, ids)
    assert n_mask > 3 * (n_keep + n_rand)


def test_bernoulli_slots_and_overflow():
    """Slots: the smallest k with P(Binomial(max_len, p) > k) ≤ 1e-6 (an exact float64 sum here too);
    a row that draws more than its slots keeps exactly that many of the drawn positions."""
    import math

    def tail(n, p, k):
        return sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k + 1, n + 1))

    for length, prob in ((64, 0.15), (128, 0.15), (256, 0.15), (32, 0.4)):
        k = num_predictions(length, prob, budget="bernoulli")
        assert tail(length, prob, k) <= 1e-6 < tail(length, prob, k - 1)
    assert num_predictions(128, budget="bernoulli") == 41
    # Long rows: the mean plus ~5 sd (2,048 tokens: 307 ± 16), where an exact comb overflows a float.
    assert 307 + 4 * 16 < num_predictions(2048, budget="bernoulli") < 307 + 6 * 16
    batch = _rows([64] * 8, 64, seed=3)
    ids = batch["input_ids"]
    big = _mask_budget(batch, 5, whole_word=False, budget="bernoulli", p=num_predictions(64, budget="bernoulli"))
    small = _mask_budget(batch, 5, whole_word=False, budget="bernoulli", p=4)
    _check_slots(small, ids)
    np.testing.assert_array_equal(small.selected.sum(1), np.minimum(big.selected.sum(1), 4))
    assert np.all(small.selected <= big.selected)          # a subset of the same draw


def test_bernoulli_refuses_whole_words():
    from tacl_jax.config import ConfigError, default_config, validate

    batch = _rows([20], 32, seed=0)
    with pytest.raises(ValueError, match="whole-word masking needs budget 'bert' or 'tacl'"):
        _mask_budget(batch, 0, whole_word=True, budget="bernoulli", p=10)
    with pytest.raises(ValueError, match="no count table"):
        selection_count(jnp.arange(3), max_len=8, budget="bernoulli")
    c = default_config()
    c.init.from_scratch = True
    validate(c)
    c.masking.budget, c.masking.whole_word = "bernoulli", True
    with pytest.raises(ConfigError, match="set masking.whole_word=False"):
        validate(c)
