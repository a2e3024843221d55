"""Training/eval batches: contents, determinism, resume, process sharding, bad inputs."""

import ml_collections
import numpy as np
import pytest

from tacl_jax import data
from tacl_jax.data import packing
from tacl_jax.data import pipeline
from tacl_jax.data import testing
from tacl_jax.data import tokenization

MAX_LEN = 32
BATCH = 8


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    return testing.write_text_corpus(str(path), testing.random_documents(300, seed=0))


@pytest.fixture(scope="module")
def tokenizer_dir():
    return tokenization.default_tokenizer_dir()


def _config(source, **overrides):
    cfg = data.default_config()
    cfg.source = source
    cfg.eval_fraction = 0.1
    cfg.read_threads = 0
    cfg.prefetch = 0
    cfg.update(overrides)
    return cfg


def _kwargs(tokenizer_dir, **overrides):
    kw = dict(global_batch_size=BATCH, max_len=MAX_LEN, seed=0, process_index=0, process_count=1,
              tokenizer_dir=tokenizer_dir, vocab_size=30522, special_ids=testing.SPECIAL_IDS,
              with_nsp=False)
    kw.update(overrides)
    return kw


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_batches_are_well_formed_text(corpus_path, tokenizer_dir):
    it = data.make_train_iterator(_config(f"text:{corpus_path}"), **_kwargs(tokenizer_dir))
    batch = next(it)
    assert sorted(batch) == ["attention_mask", "input_ids", "token_type_ids", "word_starts"]
    for v in batch.values():
        assert v.shape == (BATCH, MAX_LEN) and v.dtype == np.int32
    ids = batch["input_ids"]
    np.testing.assert_array_equal(batch["attention_mask"], ids != 0)
    assert (ids[:, 0] == 101).all()
    special = np.isin(ids, [0, 101, 102])
    assert not batch["word_starts"][special].any()
    assert not batch["token_type_ids"].any()
    words = set(testing.WORDS)
    tok = tokenization.load_tokenizer(tokenizer_dir)
    text = tok.decode(ids[0].tolist())
    assert set(text.replace(".", " ").split()) <= words
    # Every word of the corpus is one WordPiece: all non-special tokens but '.' start a word.
    dots = ids == tok.token_to_id(".")
    assert (batch["word_starts"][~special & ~dots] == 1).all()


def test_contiguous_rows_hold_the_full_sentence_rows_text_without_padding(corpus_path, tokenizer_dir):
    """data.packing='contiguous' on a text source: the same text as 'full_sentences' in the same
    order (specials aside), in rows that are full but where a document's [SEP] found no room or a
    shard ended."""
    kw = dict(max_len=MAX_LEN, tokenizer_dir=tokenizer_dir, vocab_size=30522,
              special_ids=testing.SPECIAL_IDS, with_nsp=False)
    text, lengths = {}, {}
    for mode in ("full_sentences", "contiguous"):
        rows, _ = pipeline.open_rows(_config(f"text:{corpus_path}", packing=mode, short_seq_prob=0.0), "train", **kw)
        ids = [rows[r].input_ids for r in range(len(rows))]
        text[mode] = np.concatenate([r[~np.isin(r, [101, 102])] for r in ids])
        lengths[mode] = np.array([len(r) for r in ids])
    np.testing.assert_array_equal(text["contiguous"], text["full_sentences"])
    # shards are packed apart: each ends with its ragged tail
    assert (lengths["contiguous"] < MAX_LEN - 1).sum() <= data.default_config().num_shards
    assert lengths["contiguous"].mean() > MAX_LEN - 0.5
    assert lengths["full_sentences"].mean() < MAX_LEN - 2     # whole sentences leave room unused


def test_batch_is_a_function_of_seed_and_step_and_resumes(corpus_path, tokenizer_dir):
    cfg = _config(f"text:{corpus_path}")
    run = _take(data.make_train_iterator(cfg, **_kwargs(tokenizer_dir)), 6)
    _assert_batches_equal(run, _take(data.make_train_iterator(cfg, **_kwargs(tokenizer_dir)), 6))
    other = next(data.make_train_iterator(cfg, **_kwargs(tokenizer_dir, seed=1)))
    assert not np.array_equal(other["input_ids"], run[0]["input_ids"])

    it = data.make_train_iterator(cfg, **_kwargs(tokenizer_dir))
    _take(it, 2)
    state = it.get_state()
    assert state["step"] == 2
    import json
    state = json.loads(json.dumps(state))  # Survives a JSON checkpoint.
    resumed = data.make_train_iterator(cfg, **_kwargs(tokenizer_dir))
    resumed.set_state(state)
    _assert_batches_equal(_take(resumed, 4), run[2:])
    _assert_batches_equal(_take(it, 4), run[2:])


def test_process_counts_give_the_same_global_batch(corpus_path, tokenizer_dir):
    cfg = _config(f"text:{corpus_path}", packing="nsp_pairs")
    kw = _kwargs(tokenizer_dir, with_nsp=True)
    one = _take(data.make_train_iterator(cfg, **kw), 5)
    parts = [_take(data.make_train_iterator(cfg, **dict(kw, process_index=p, process_count=2)), 5)
             for p in range(2)]
    for step in range(5):
        for key in one[step]:
            np.testing.assert_array_equal(
                np.concatenate([parts[0][step][key], parts[1][step][key]]), one[step][key])
    assert parts[0][0]["input_ids"].shape == (BATCH // 2, MAX_LEN)
    assert set(np.unique(one[0]["next_sentence_label"])) <= {0, 1}
    tt = one[0]["token_type_ids"]
    assert tt.any() and (tt <= one[0]["attention_mask"]).all()
    evals = [data.make_eval_batches(cfg, num_batches=2, **dict(kw, process_index=p,
                                                                process_count=2))
             for p in range(2)]
    full = data.make_eval_batches(cfg, num_batches=2, **kw)
    for b in range(2):
        np.testing.assert_array_equal(
            np.concatenate([evals[0][b]["input_ids"], evals[1][b]["input_ids"]]),
            full[b]["input_ids"])


def _rows(n, length=5):
    tokens = np.arange(n * length, dtype=np.int32) + 1000
    return packing.PackedRows(tokens, np.ones(n * length, np.uint8),
                              np.arange(0, n * length + 1, length), np.full(n, length, np.int32),
                              np.zeros(n, np.int32))


def test_process_shards_are_disjoint_and_cover_each_epoch():
    rows, global_batch = _rows(30), 6
    streams = [pipeline.ShuffledBatches(rows, seed=7, global_batch_size=global_batch,
                                        process_index=p, process_count=2, collate_fn=list)
               for p in range(2)]
    for epoch in range(3):
        steps = range(epoch * 5, (epoch + 1) * 5)
        seen = [np.concatenate([s.indices(t) for t in steps]) for s in streams]
        assert not set(seen[0]) & set(seen[1])
        assert sorted(np.concatenate(seen)) == list(range(30))
    assert not np.array_equal(streams[0].permutation(0), streams[0].permutation(1))
    # A global batch straddling an epoch boundary: 30 rows, batches of 4 -> step 7 = rows 28..31.
    straddle = pipeline.ShuffledBatches(rows, seed=7, global_batch_size=4, process_index=0,
                                        process_count=1, collate_fn=list)
    np.testing.assert_array_equal(straddle.indices(7), np.concatenate(
        [straddle.permutation(0)[28:], straddle.permutation(1)[:2]]))


def test_eval_batches_are_fixed_and_held_out(corpus_path, tokenizer_dir):
    cfg = _config(f"text:{corpus_path}")
    evals = data.make_eval_batches(cfg, num_batches=3, **_kwargs(tokenizer_dir))
    assert len(evals) == 3
    _assert_batches_equal(evals, data.make_eval_batches(cfg, num_batches=3,
                                                        **_kwargs(tokenizer_dir, seed=5)))
    train = {tuple(r) for b in _take(data.make_train_iterator(cfg, **_kwargs(tokenizer_dir)), 30)
             for r in b["input_ids"]}
    held = {tuple(r) for b in evals for r in b["input_ids"]}
    assert not train & held


@pytest.mark.slow
def test_worker_processes_give_the_same_batches(corpus_path, tokenizer_dir):
    kw = _kwargs(tokenizer_dir)
    ref = _take(data.make_train_iterator(_config(f"text:{corpus_path}"), **kw), 3)
    it = data.make_train_iterator(_config(f"text:{corpus_path}", worker_count=1, prefetch=2), **kw)
    try:
        _assert_batches_equal(_take(it, 3), ref)
    finally:
        it.close()


def test_synthetic_delegates_and_resumes():
    cfg = _config("synthetic")
    kw = _kwargs(None, vocab_size=1000, special_ids={"pad": 0, "unk": 1, "cls": 2, "sep": 3,
                                                     "mask": 4}, with_nsp=True)
    it = data.make_train_iterator(cfg, **kw)
    batches = _take(it, 3)
    assert batches[0]["input_ids"].shape == (BATCH, MAX_LEN)
    assert batches[0]["input_ids"].max() < 1000 and batches[0]["next_sentence_label"].shape == (8,)
    resumed = data.make_train_iterator(cfg, **kw)
    resumed.set_state({"step": 1})
    _assert_batches_equal(_take(resumed, 2), batches[1:])
    half = data.make_train_iterator(cfg, **dict(kw, process_index=1, process_count=2))
    np.testing.assert_array_equal(next(half)["input_ids"], batches[0]["input_ids"][4:])
    evals = data.make_eval_batches(cfg, num_batches=2, **kw)
    assert len(evals) == 2 and not np.array_equal(evals[0]["input_ids"], batches[0]["input_ids"])


# -- Bad inputs --------------------------------------------------------------------------------


def test_tokenizer_must_match_the_model(corpus_path, tokenizer_dir, tmp_path):
    cfg = _config(f"text:{corpus_path}")
    with pytest.raises(ValueError, match=r"30522 tokens but the model's vocab_size is 1000"):
        data.make_train_iterator(cfg, **_kwargs(tokenizer_dir, vocab_size=1000))
    with pytest.raises(ValueError, match="special token ids"):
        data.make_train_iterator(cfg, **_kwargs(tokenizer_dir, special_ids=dict(
            testing.SPECIAL_IDS, mask=4)))
    with pytest.raises(FileNotFoundError, match="config.init.hf_path"):
        data.make_train_iterator(cfg, **_kwargs(None))
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor vocab.txt"):
        data.make_train_iterator(cfg, **_kwargs(str(tmp_path)))


def test_corpus_too_small_or_empty(tmp_path, tokenizer_dir):
    small = testing.write_text_corpus(str(tmp_path / "small.txt"),
                                      testing.random_documents(3, seed=1, max_sentences=2))
    with pytest.raises(ValueError, match=r"small.txt.*fewer than one global batch of 64"):
        data.make_train_iterator(_config(f"text:{small}"),
                                 **_kwargs(tokenizer_dir, global_batch_size=64))
    with pytest.raises(ValueError, match="held-out split"):
        data.make_eval_batches(_config(f"text:{small}", eval_fraction=0.01), num_batches=1,
                               **_kwargs(tokenizer_dir))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\t\n")
    with pytest.raises(ValueError, match="empty.txt.*no non-empty document"):
        data.make_train_iterator(_config(f"text:{empty}"), **_kwargs(tokenizer_dir))


def test_bad_layout_and_nsp_without_pairs(corpus_path, tokenizer_dir):
    cfg = _config(f"text:{corpus_path}")
    with pytest.raises(ValueError, match="multiple of the process count"):
        data.make_train_iterator(cfg, **_kwargs(tokenizer_dir, global_batch_size=6,
                                                process_count=4))
    with pytest.raises(ValueError, match="packing='nsp_pairs'"):
        data.make_train_iterator(cfg, **_kwargs(tokenizer_dir, with_nsp=True))
    bad = ml_collections.ConfigDict(cfg.to_dict())
    bad.packing = "pairs"
    with pytest.raises(ValueError, match="config.data.packing"):
        data.make_train_iterator(bad, **_kwargs(tokenizer_dir))
