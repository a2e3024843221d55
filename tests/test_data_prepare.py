"""Prepared datasets: TFDS round trip, equality with on-the-fly packing, checks, the CLI, tfds:."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds
from etils import epath

from tacl_jax import data
from tacl_jax.data import prepare
from tacl_jax.data import sources
from tacl_jax.data import testing
from tacl_jax.data import tfds_builder
from tacl_jax.data import tokenization

MAX_LEN = 48
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer_dir():
    return tokenization.default_tokenizer_dir()


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    return testing.write_text_corpus(str(path), testing.random_documents(200, seed=3))


def _config(source, **overrides):
    cfg = data.default_config()
    cfg.source = source
    cfg.packing = "nsp_pairs"
    cfg.eval_fraction = 0.1
    cfg.num_shards = 3
    cfg.read_threads = 0
    cfg.prefetch = 0
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus_path, tokenizer_dir):
    out = str(tmp_path_factory.mktemp("prepared"))
    summary = prepare.prepare_dataset(_config(f"text:{corpus_path}"), out=out, max_len=MAX_LEN,
                                      tokenizer_dir=tokenizer_dir, workers=1)
    return out, summary


def _kwargs(tokenizer_dir, **overrides):
    kw = dict(global_batch_size=8, max_len=MAX_LEN, seed=0, process_index=0, process_count=1,
              tokenizer_dir=tokenizer_dir, vocab_size=30522, special_ids=testing.SPECIAL_IDS,
              with_nsp=True)
    kw.update(overrides)
    return kw


def test_summary_counts(prepared):
    out, summary = prepared
    counts = summary["counts"]
    assert summary["path"] == os.path.join(out, "tacl_packed", "1.0.0")
    assert counts["train"]["documents"] + counts["validation"]["documents"] == 200
    assert counts["train"]["rows"] > 100 and counts["validation"]["rows"] > 8


def test_tfds_round_trip_equals_fast_reader_and_on_the_fly_rows(prepared, corpus_path,
                                                                  tokenizer_dir):
    out, summary = prepared
    ours = tfds_builder.PreparedRows(out, "train")
    assert len(ours) == summary["counts"]["train"]["rows"]
    assert ours.metadata["packing"] == "nsp_pairs" and ours.metadata["max_len"] == MAX_LEN
    by_name = tfds.data_source("tacl_packed", data_dir=out)["train"]
    by_dir = tfds.builder_from_directory(summary["path"]).as_data_source()["train"]
    in_memory, _ = data.pipeline._pack_in_memory(  # pylint: disable=protected-access
        json.dumps(_config(f"text:{corpus_path}").to_dict(), sort_keys=True), MAX_LEN,
        tokenizer_dir, json.dumps(testing.SPECIAL_IDS, sort_keys=True))
    assert len(by_name) == len(by_dir) == len(in_memory["train"]) == len(ours)
    for i in list(range(0, len(ours), 7)) + [len(ours) - 1]:
        row, mem = ours[i], in_memory["train"][i]
        for ex in (by_name[i], by_dir[i]):
            np.testing.assert_array_equal(ex["input_ids"], row.input_ids)
            np.testing.assert_array_equal(ex["word_starts"], row.word_starts)
            assert ex["segment_a_len"] == row.segment_a_len
            assert ex["next_sentence_label"] == row.next_sentence_label
        np.testing.assert_array_equal(mem.input_ids, row.input_ids)
        np.testing.assert_array_equal(mem.word_starts, row.word_starts)
        assert (mem.segment_a_len, mem.next_sentence_label) == (row.segment_a_len,
                                                                row.next_sentence_label)


def test_prepared_and_on_the_fly_training_see_the_same_batches(prepared, corpus_path,
                                                               tokenizer_dir):
    out, _ = prepared
    kw = _kwargs(tokenizer_dir)
    a = data.make_train_iterator(_config(f"prepared:{out}"), **kw)
    b = data.make_train_iterator(_config(f"text:{corpus_path}"), **kw)
    for _ in range(3):
        x, y = next(a), next(b)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    ea = data.make_eval_batches(_config(f"prepared:{out}"), num_batches=1, **kw)
    eb = data.make_eval_batches(_config(f"text:{corpus_path}"), num_batches=1, **kw)
    np.testing.assert_array_equal(ea[0]["input_ids"], eb[0]["input_ids"])


def test_prepared_dataset_must_match_the_run(prepared, tokenizer_dir, tmp_path):
    out, _ = prepared
    cfg = _config(f"prepared:{out}")
    with pytest.raises(ValueError, match="prepared for max_len=48"):
        data.make_train_iterator(cfg, **_kwargs(tokenizer_dir, max_len=64))
    with pytest.raises(ValueError, match="special ids"):
        data.make_train_iterator(cfg, **_kwargs(tokenizer_dir, special_ids=dict(
            testing.SPECIAL_IDS, pad=1)))
    with pytest.raises(ValueError, match="larger than the model's vocab_size=100"):
        data.make_train_iterator(cfg, **_kwargs(tokenizer_dir, vocab_size=100))
    toy = testing.write_toy_tokenizer(str(tmp_path / "toy"))
    with pytest.raises(ValueError, match="another vocabulary"):
        data.make_train_iterator(cfg, **_kwargs(toy))
    with pytest.raises(FileNotFoundError, match="tacl_jax.data.prepare"):
        data.make_train_iterator(_config(f"prepared:{tmp_path}"), **_kwargs(tokenizer_dir))
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare.prepare_dataset(_config("builtin:python_docs"), out=out, max_len=MAX_LEN,
                                tokenizer_dir=tokenizer_dir)
    with pytest.raises(ValueError, match="text source"):
        prepare.prepare_dataset(_config("synthetic"), out=str(tmp_path), max_len=MAX_LEN,
                                tokenizer_dir=tokenizer_dir)


def test_empty_held_out_split_is_a_clear_error(tmp_path, tokenizer_dir):
    small = testing.write_text_corpus(str(tmp_path / "small.txt"), testing.random_documents(5))
    with pytest.raises(ValueError, match="held-out split is empty"):
        prepare.prepare_dataset(_config(f"text:{small}", eval_fraction=0.01), out=str(tmp_path),
                                max_len=MAX_LEN, tokenizer_dir=tokenizer_dir)


class TaclTestText(tfds.core.GeneratorBasedBuilder):
    """A tiny text dataset, to test 'tfds:' sources without a download."""
    VERSION = tfds.core.Version("1.0.0")
    DOCS = testing.random_documents(12, seed=9)

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):  # pylint: disable=no-self-argument
        return epath.Path(__file__)

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "title": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i, lines in enumerate(self.DOCS):
            yield i, {"text": "\n".join(lines), "title": f"doc {i}"}


def test_tfds_text_source(tmp_path):
    TaclTestText(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    cfg = _config("tfds:tacl_test_text", data_dir=str(tmp_path))
    docs = list(sources.open_source(cfg).documents())
    # TFDS shuffles examples by key hash on write: compare as sets.
    assert sorted(d for _, d in docs) == sorted(TaclTestText.DOCS)
    assert [i for i, _ in sources.open_source(cfg).documents(1, 2)] == list(range(1, 12, 2))
    with pytest.raises(ValueError, match="no field 'body'"):
        list(sources.open_source(_config("tfds:tacl_test_text", data_dir=str(tmp_path),
                                         text_field="body")).documents())
    with pytest.raises(FileNotFoundError, match="data_dir"):
        list(sources.open_source(_config("tfds:no_such_dataset_xyz",
                                         data_dir=str(tmp_path))).documents())


@pytest.mark.slow
def test_cli_with_worker_processes(tmp_path, corpus_path, tokenizer_dir):
    config_file = tmp_path / "cfg.py"
    config_file.write_text(
        "import ml_collections\n"
        "from tacl_jax.data import config as data_config\n"
        "def get_config():\n"
        "    c = ml_collections.ConfigDict()\n"
        "    c.data = data_config.default_config()\n"
        "    c.max_len = 40\n"
        "    c.global_batch_size = 4\n"
        "    c.seed = 0\n"
        f"    c.init = ml_collections.ConfigDict(dict(hf_path={tokenizer_dir!r}))\n"
        "    return c\n")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "tacl_jax.data.prepare", f"--config={config_file}", f"--out={out}",
         f"--config.data.source=text:{corpus_path}", "--config.data.num_shards=2", "--workers=2"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["counts"]["train"]["rows"] == len(tfds_builder.PreparedRows(str(out), "train"))
    assert "prepared:" in result.stderr
