"""Document sources and text clean-up: formats, sharding, the builtin corpus, bad inputs."""

import gzip
import logging

import ml_collections
import numpy as np
import pytest

from tacl_jax.data import config as data_config
from tacl_jax.data import preprocess
from tacl_jax.data import python_docs
from tacl_jax.data import sources
from tacl_jax.data import testing


def _docs(source, shard_index=0, shard_count=1):
    return list(source.documents(shard_index, shard_count))


def test_text_blank_line_and_line_separators(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("First  doc line.\n\tSecond\x00 line.\n\n\n  \nSecond doc.\n")
    docs = _docs(sources.TextFiles(str(path)))
    assert docs == [(0, ["First doc line.", "Second line."]), (1, ["Second doc."])]
    docs = _docs(sources.TextFiles(str(path), doc_separator="line"))
    assert [d for _, d in docs] == [["First doc line."], ["Second line."], ["Second doc."]]


def test_globs_gz_and_jsonl_are_read_in_sorted_order(tmp_path):
    docs = testing.random_documents(6, seed=1)
    testing.write_text_corpus(tmp_path / "b.txt", docs[:2])
    with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
        f.write("\n\n".join("\n".join(d) for d in docs[2:4]))
    testing.write_jsonl_corpus(tmp_path / "a.jsonl", docs[4:], field="body")
    src = sources.TextFiles(f"{tmp_path}/*.txt*,{tmp_path}/a.jsonl", text_field="body")
    assert [d for _, d in _docs(src)] == docs[:4] + docs[4:]
    assert src.files[0].endswith("b.txt")


def test_shards_are_disjoint_and_cover_the_corpus(tmp_path):
    docs = testing.random_documents(23, seed=2)
    src = sources.TextFiles(testing.write_text_corpus(str(tmp_path / "t.txt"), docs))
    shards = [_docs(src, k, 4) for k in range(4)]
    indices = sorted(i for shard in shards for i, _ in shard)
    assert indices == list(range(23))
    assert all(i % 4 == k for k, shard in enumerate(shards) for i, _ in shard)


def test_undecodable_bytes_are_replaced_and_counted(tmp_path, caplog):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Caf\xe9 au lait.\nNa\xefve \ufffd kept.\n".encode("latin-1", errors="replace")
                     .replace(b"?", "\ufffd".encode()))
    src = sources.TextFiles(str(path))
    with caplog.at_level(logging.WARNING):
        docs = _docs(src)
    assert docs[0][1] == ["Caf\ufffd au lait.", "Na\ufffdve \ufffd kept."]
    assert src.stats.replaced_bytes == 2  # The genuine U+FFFD is not counted.
    assert "latin1.txt" in caplog.text and "iconv" in caplog.text


def test_huge_line_is_reported_and_split(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(preprocess, "HUGE_LINE_CHARS", 1000)
    path = tmp_path / "huge.txt"
    text = " ".join(["word"] * 30_000)  # 150k characters, no sentence end.
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        ((_, lines),) = _docs(sources.TextFiles(str(path)))
    assert "huge.txt:1" in caplog.text
    sentences = preprocess.split_sentences(lines[0])
    assert max(map(len, sentences)) <= preprocess.MAX_SENTENCE_CHARS
    assert " ".join(sentences) == text


def test_split_sentences_keeps_all_text():
    line = 'He said "Stop." Then 3 dogs ran! Did they? (Yes.) e.g. this stays. Ok'
    sentences = preprocess.split_sentences(line)
    assert sentences == ['He said "Stop."', "Then 3 dogs ran!", "Did they?", "(Yes.) e.g. this stays.",
                         "Ok"]
    assert " ".join(sentences) == line


def test_eval_documents_are_a_stable_fraction():
    held = [i for i in range(10_000) if preprocess.is_eval_document(i, 0.05)]
    assert 480 <= len(held) <= 520
    assert not any(preprocess.is_eval_document(i, 0.0) for i in range(100))


@pytest.mark.parametrize("source,error,match", [
    ("text:/nonexistent/file.txt", FileNotFoundError, "no such file"),
    ("text:/nonexistent/*.txt", FileNotFoundError, "matched no files"),
    ("/some/file.txt", ValueError, "not a data source"),
    ("builtin:nope", ValueError, "builtin:python_docs"),
    ("text:", ValueError, "not a data source"),
])
def test_bad_sources(source, error, match):
    cfg = data_config.default_config()
    cfg.source = source
    with pytest.raises(error, match=match):
        sources.open_source(cfg)


def test_directory_bad_gzip_and_bad_jsonl(tmp_path):
    with pytest.raises(FileNotFoundError, match="is a directory"):
        sources.TextFiles(str(tmp_path))
    (tmp_path / "bad.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="bad.txt.gz"):
        _docs(sources.TextFiles(str(tmp_path / "bad.txt.gz")))
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"a.jsonl:1 has no field 'text'.*text_field"):
        _docs(sources.TextFiles(str(tmp_path / "a.jsonl")))
    (tmp_path / "b.jsonl").write_text("plain text\n")
    with pytest.raises(ValueError, match="b.jsonl:1 is not valid JSON"):
        _docs(sources.TextFiles(str(tmp_path / "b.jsonl")))


def test_config_validation():
    cfg = data_config.default_config()
    data_config.validate(cfg)
    for key, value in [("packing", "roberta"), ("short_seq_prob", 2.0), ("eval_fraction", 1.0),
                       ("num_shards", 0), ("text_doc_separator", "para")]:
        bad = ml_collections.ConfigDict(cfg.to_dict())
        bad[key] = value
        with pytest.raises(ValueError, match=key):
            data_config.validate(bad)


@pytest.mark.slow
def test_builtin_python_docs_is_real_english():
    docs = python_docs.documents()
    assert len(docs) > 2000
    chars = sum(len(line) for doc in docs for line in doc)
    assert chars > 1_000_000
    assert all(doc and all(line and line == preprocess.clean_line(line) for line in doc)
               for doc in docs[:500])
    text = " ".join(docs[0])
    assert " the " in text
    src = sources.Builtin("python_docs")
    assert [i for i, _ in _docs(src, 1, 3)][:3] == [1, 4, 7]
    assert np.mean([len(d) for d in docs]) >= 1
