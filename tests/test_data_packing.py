"""Packing: nothing lost or duplicated, whole sentences, well-formed NSP pairs, padding."""

import numpy as np
import pytest

from tacl_jax.data import packing
from tacl_jax.data import pipeline

CLS, SEP, PAD = 101, 102, 0


def _corpus(seed, num_docs=40, max_sentence=30):
    """Documents of sentences with unique, increasing ids (>= 1000), so order is checkable."""
    rng = np.random.default_rng(seed)
    docs, next_id = [], 1000
    for _ in range(num_docs):
        doc = []
        for _ in range(int(rng.integers(1, 8))):
            n = int(rng.integers(1, max_sentence))
            ids = np.arange(next_id, next_id + n, dtype=np.int32)
            next_id += n
            starts = (rng.random(n) < 0.7).astype(np.uint8)
            starts[0] = 1
            doc.append((ids, starts))
        docs.append(doc)
    return docs


def _pack(cls, docs, max_len, short_seq_prob=0.1, seed=0):
    packer = cls(max_len=max_len, cls_id=CLS, sep_id=SEP, short_seq_prob=short_seq_prob,
                 rng=np.random.default_rng(seed))
    for doc in docs:
        packer.add_document(doc)
    return packer, packer.finish()


def _content(docs):
    return np.concatenate([ids for doc in docs for ids, _ in doc])


@pytest.mark.parametrize("max_len,short", [(16, 0.1), (64, 0.0), (64, 1.0), (5, 0.1)])
def test_full_sentences_lose_and_duplicate_nothing(max_len, short):
    docs = _corpus(seed=max_len)
    packer, rows = _pack(packing.FullSentencePacker, docs, max_len, short)
    assert packer.num_tokens == len(_content(docs))
    content = []
    for r in range(len(rows)):
        row = rows[r]
        assert 3 <= len(row.input_ids) <= max_len
        assert row.input_ids[0] == CLS and row.input_ids[-1] == SEP
        assert row.segment_a_len == len(row.input_ids) and row.next_sentence_label == 0
        inner = row.input_ids[1:-1]
        assert inner[0] != SEP and inner[-1] != SEP  # Document separators only between text.
        special = (row.input_ids == CLS) | (row.input_ids == SEP)
        assert not row.word_starts[special].any()
        content.append(inner[inner != SEP])
    np.testing.assert_array_equal(np.concatenate(content), _content(docs))


def test_full_sentences_are_whole_and_cut_only_when_too_long():
    docs = _corpus(seed=1, max_sentence=40)
    max_len = 24
    _, rows = _pack(packing.FullSentencePacker, docs, max_len, short_seq_prob=0.0)
    starts = {int(ids[0]) for doc in docs for ids, _ in doc}
    ends = {int(ids[-1]) for doc in docs for ids, _ in doc if len(ids) <= max_len - 2}
    sentence_of = {int(t): len(ids) for doc in docs for ids, _ in doc for t in ids}
    for r in range(len(rows)):
        inner = rows[r].input_ids[1:-1]
        inner = inner[inner != SEP]
        first, last = int(inner[0]), int(inner[-1])
        # A row starts at a sentence start or inside a sentence too long for any row.
        assert first in starts or sentence_of[first] > max_len - 2
        assert last in ends or sentence_of[last] > max_len - 2
        # A cut piece starts with a word-start flag.
        assert rows[r].word_starts[1] == 1


def test_documents_are_separated_by_sep_in_full_sentences():
    docs = [[(np.array([1000, 1001], np.int32), np.ones(2, np.uint8))],
            [(np.array([2000], np.int32), np.ones(1, np.uint8))]]
    _, rows = _pack(packing.FullSentencePacker, docs, max_len=16, short_seq_prob=0.0)
    assert len(rows) == 1
    np.testing.assert_array_equal(rows[0].input_ids, [CLS, 1000, 1001, SEP, 2000, SEP])


@pytest.mark.parametrize("max_len,short", [(16, 0.0), (64, 0.0), (64, 0.1), (5, 0.0)])
def test_contiguous_rows_are_full_and_cut_the_corpus_in_order(max_len, short):
    """Every token once, in corpus order; rows of exactly max_len but the last (short_seq_prob 0) and
    one where a document ends a token before the row does;
    one [SEP] exactly where two documents meet inside a row, never at a row's edge; a row's first
    text token is a word start."""
    docs = _corpus(seed=max_len + int(10 * short), max_sentence=40)
    packer, rows = _pack(packing.ContiguousPacker, docs, max_len, short)
    assert packer.num_tokens == len(_content(docs)) and packer.num_cut_sentences == 0
    doc_of = {int(t): d for d, doc in enumerate(docs) for ids, _ in doc for t in ids}
    content = []
    for r in range(len(rows)):
        row = rows[r]
        ids = row.input_ids
        assert ids[0] == CLS and ids[-1] == SEP and row.segment_a_len == len(ids)
        if short == 0.0 and r < len(rows) - 1:
            # one short only where a document ends a token before the row: its [SEP] has no room
            nxt = int(rows[r + 1].input_ids[1])
            assert len(ids) == max_len or (len(ids) == max_len - 1 and doc_of[nxt] != doc_of[int(ids[-2])])
        inner = ids[1:-1]
        assert inner[0] != SEP and inner[-1] != SEP and row.word_starts[1] == 1
        text = inner[inner != SEP]
        # a [SEP] inside a row sits exactly between the last token of one document and the next's first
        meets = [i for i in range(1, len(text)) if doc_of[int(text[i])] != doc_of[int(text[i - 1])]]
        assert list(np.flatnonzero(inner == SEP)) == [i + k for k, i in enumerate(meets)]
        content.append(text)
    np.testing.assert_array_equal(np.concatenate(content), _content(docs))


def test_contiguous_one_document_is_the_peers_rows():
    """One document: rows are [CLS] + consecutive (max_len − 2)-token slices + [SEP], as
    bench/torch_peer.py cuts its rows (which drops the ragged tail this packer keeps)."""
    doc = [(np.arange(1000, 1000 + n, dtype=np.int32), np.ones(n, np.uint8)) for n in (7, 30, 3, 19)]
    _, rows = _pack(packing.ContiguousPacker, [doc], max_len=12, short_seq_prob=0.0)
    stream = _content([doc])
    want = [[CLS, *stream[s:s + 10], SEP] for s in range(0, len(stream), 10)]
    assert [list(rows[r].input_ids) for r in range(len(rows))] == want
    assert packing.make_packer("contiguous", max_len=12, cls_id=CLS, sep_id=SEP, short_seq_prob=0.0,
                               rng=np.random.default_rng(0)).__class__ is packing.ContiguousPacker


@pytest.mark.parametrize("max_len", [8, 32, 128])
def test_nsp_pairs_well_formed_and_own_text_covered_once(max_len):
    docs = _corpus(seed=max_len, num_docs=60)
    all_tokens = _content(docs)
    position = {int(t): i for i, t in enumerate(all_tokens)}
    _, rows = _pack(packing.NspPairPacker, docs, max_len)
    own, labels = [], []
    for r in range(len(rows)):
        row = rows[r]
        ids = row.input_ids
        assert len(ids) <= max_len and ids[0] == CLS and ids[-1] == SEP
        seps = np.flatnonzero(ids == SEP)
        assert len(seps) == 2 and seps[0] == row.segment_a_len - 1
        a, b = ids[1:seps[0]], ids[seps[0] + 1:-1]
        assert len(a) >= 1 and len(b) >= 1
        assert not row.word_starts[[0, seps[0], len(ids) - 1]].any()
        # Both segments are contiguous text.
        for seg in (a, b):
            np.testing.assert_array_equal(np.diff([position[int(t)] for t in seg]), 1)
        labels.append(row.next_sentence_label)
        own.append(a)
        if row.next_sentence_label == 0:
            assert position[int(b[0])] == position[int(a[-1])] + 1  # B continues A.
            own.append(b)
    np.testing.assert_array_equal(np.concatenate(own), all_tokens)
    if max_len >= 128:  # ~1/2 random, plus the single-sentence chunks (always random).
        assert 0.4 < np.mean(labels) < 0.8, np.mean(labels)


def test_sentence_pieces_cut_long_sentences_and_flag_word_starts():
    ids = np.arange(1000, 1010, dtype=np.int32)
    starts = np.array([1, 0, 0, 1, 0, 0, 0, 1, 0, 0], np.uint8)
    pieces = packing.sentence_pieces([(ids, starts), (ids[:0], starts[:0])], limit=4)
    assert [len(p[0]) for p in pieces] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in pieces]), ids)
    assert [int(p[1][0]) for p in pieces] == [1, 1, 1]
    assert starts[4] == 0  # The input is not modified.


def test_packed_rows_concatenate_and_collate():
    docs = _corpus(seed=3)
    _, a = _pack(packing.NspPairPacker, docs[:20], 32)
    _, b = _pack(packing.NspPairPacker, docs[20:], 32)
    both = packing.PackedRows.concatenate([a, b])
    assert len(both) == len(a) + len(b)
    np.testing.assert_array_equal(both[len(a)].input_ids, b[0].input_ids)
    batch = pipeline.collate(both.__getitems__(range(4)), max_len=40, pad_id=PAD, with_nsp=True)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "word_starts",
                          "next_sentence_label"}
    for r in range(4):
        row = both[r]
        n = len(row.input_ids)
        np.testing.assert_array_equal(batch["input_ids"][r, :n], row.input_ids)
        assert (batch["input_ids"][r, n:] == PAD).all()
        np.testing.assert_array_equal(batch["attention_mask"][r], np.arange(40) < n)
        np.testing.assert_array_equal(batch["token_type_ids"][r],
                                      (np.arange(40) >= row.segment_a_len) & (np.arange(40) < n))
        assert batch["next_sentence_label"][r] == row.next_sentence_label
    assert all(v.dtype == np.int32 for v in batch.values())
    with pytest.raises(ValueError, match="max_len"):
        pipeline.collate(both.__getitems__([0]), max_len=4, pad_id=PAD, with_nsp=False)


def test_max_len_too_small_is_refused():
    with pytest.raises(ValueError, match="max_len"):
        packing.NspPairPacker(max_len=4, cls_id=CLS, sep_id=SEP, short_seq_prob=0.0,
                              rng=np.random.default_rng(0))
