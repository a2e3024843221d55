r"""Prepare once, train many times: tokenize and pack a corpus into an ArrayRecord TFDS dataset.

    python -m tacl_jax.data.prepare --config=configs/demo.py --out=/data/demo_packed \
        [--config.data.source=text:/corpus/*.txt.gz] [--workers=8] [--overwrite]

Reads ``config.data`` (source, packing, short_seq_prob, eval_fraction, num_shards), ``config.max_len``
and the tokenizer beside the init checkpoint (``config.init.hf_path``, or ``--tokenizer_dir``).
One worker process per shard tokenizes and packs; the main process writes the rows with TFDS
(progress bar per split). Prints a JSON summary with the documents, tokens and rows of each split.
Train on it with ``--config.data.source=prepared:/data/demo_packed``.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import shutil
import sys

import ml_collections

from tacl_jax.data import config as data_config_lib
from tacl_jax.data import corpus
from tacl_jax.data import sources
from tacl_jax.data import tfds_builder
from tacl_jax.data import tokenization

FORMAT_VERSION = 1


@functools.lru_cache(maxsize=2)
def _encoder(tokenizer_dir: str) -> tokenization.SentenceEncoder:
    return tokenization.SentenceEncoder(tokenization.load_tokenizer(tokenizer_dir))


def _pack_task(task: tuple) -> tuple[int, corpus.ShardResult]:
    """One shard of one split (runs in a worker process)."""
    data_dict, tokenizer_dir, spec, split, shard = task
    source = sources.open_source(ml_collections.ConfigDict(data_dict))
    (result,) = corpus.pack_shards(source, _encoder(tokenizer_dir), spec, split, [shard])
    return shard, result


def prepare_dataset(data_config: ml_collections.ConfigDict, *, out: str, max_len: int,
                    tokenizer_dir: str, workers: int = 1, overwrite: bool = False) -> dict:
    """Writes the prepared dataset under ``out`` and returns ``{'path', 'counts'}``.

    ``counts`` maps each split to ``documents``, ``tokens``, ``rows``, ``cut_sentences`` and
    ``replaced_bytes``. Raises ValueError for a source that is not text or has no documents, and
    FileExistsError if ``out`` already holds a dataset and not ``overwrite``.
    """
    data_config_lib.validate(data_config)
    kind, _ = sources.parse_source(data_config.source)
    if kind in ("synthetic", "prepared"):
        raise ValueError(f"prepare needs a text source, not {data_config.source!r}; set "
                         "--config.data.source=text:... / tfds:... / builtin:python_docs")
    sources.open_source(data_config)  # Fail fast on a missing path before any work.
    tok = tokenization.load_tokenizer(tokenizer_dir)
    special_ids = tokenization.bert_special_ids(tok, tokenizer_dir)
    spec = corpus.PackSpec.from_config(data_config, max_len=max_len, special_ids=special_ids)

    version_dir = os.path.join(out, tfds_builder.DATASET_NAME, str(tfds_builder.TaclPacked.VERSION))
    if os.path.exists(version_dir):
        if not overwrite:
            raise FileExistsError(f"{version_dir} already exists: pass --overwrite to replace it, "
                                  "or choose another --out")
        shutil.rmtree(version_dir)

    # The small held-out split first, so that an empty one fails before the long train split.
    splits = ("validation", "train") if spec.eval_fraction > 0 else ("train",)
    metadata = dict(
        format_version=FORMAT_VERSION, source=data_config.source,
        text_doc_separator=data_config.text_doc_separator, text_field=data_config.text_field,
        packing=spec.packing, max_len=spec.max_len, short_seq_prob=spec.short_seq_prob,
        eval_fraction=spec.eval_fraction, num_shards=spec.num_shards,
        tokenizer_dir=os.path.abspath(tokenizer_dir),
        tokenizer_vocab_size=tok.get_vocab_size(with_added_tokens=True),
        vocab_fingerprint=tokenization.vocab_fingerprint(tok), special_ids=special_ids,
        counts={})
    data_dict = data_config.to_dict()
    workers = max(1, min(workers, spec.num_shards))
    results: dict[str, list[corpus.ShardResult]] = {}

    def shards(split):
        tasks = [(data_dict, tokenizer_dir, spec, split, k) for k in range(spec.num_shards)]
        done = results.setdefault(split, [])
        stream = pool.imap(_pack_task, tasks) if pool else map(_pack_task, tasks)
        for shard, result in stream:
            logging.info("%s shard %d/%d: %d documents, %d tokens, %d rows", split, shard + 1,
                         spec.num_shards, result.documents, result.tokens, len(result.rows))
            done.append(result)
            yield shard, result.rows
        counts = corpus.report(data_config.source, split, done)
        metadata["counts"][split] = counts
        if counts["documents"] == 0 and split == "train":
            raise ValueError(f"{data_config.source!r} has no non-empty documents for training: "
                             "check the files, config.data.text_field and eval_fraction")

    # 'spawn': workers must not inherit the parent's tokenizer threads (or JAX, if imported).
    pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else None
    try:
        builder = tfds_builder.TaclPacked(shards=shards, splits=splits, metadata=metadata,
                                          data_dir=out, file_format="array_record")
        try:
            builder.download_and_prepare()
        except AssertionError as e:  # TFDS: "No examples were yielded." for an empty split.
            if "No examples" not in str(e):
                raise
            raise ValueError(
                f"{data_config.source!r}: the held-out split is empty (eval_fraction="
                f"{spec.eval_fraction} of {sum(r.documents for r in results.get('train', []))} "
                "documents). Raise config.data.eval_fraction, use a larger corpus, or set it to 0 "
                "for no held-out split.") from e
    finally:
        if pool:
            pool.close()
            pool.join()
    return dict(path=builder.data_path.as_posix() if hasattr(builder.data_path, "as_posix")
                else str(builder.data_path), counts=metadata["counts"])


def main(argv):
    del argv
    from absl import flags  # pylint: disable=import-outside-toplevel
    cfg = flags.FLAGS.config
    tokenizer_dir = flags.FLAGS.tokenizer_dir or cfg.get("init", {}).get("hf_path")
    summary = prepare_dataset(cfg.data, out=flags.FLAGS.out, max_len=cfg.max_len,
                              tokenizer_dir=tokenizer_dir, workers=flags.FLAGS.workers,
                              overwrite=flags.FLAGS.overwrite)
    rows = summary["counts"]["train"]["rows"]
    if "global_batch_size" in cfg and rows < cfg.global_batch_size:
        logging.warning("only %d training rows, fewer than one global batch (%d): training will "
                        "refuse this dataset; use a larger corpus or a smaller batch/max_len",
                        rows, cfg.global_batch_size)
    print(json.dumps(summary))
    print(f"Train on it with --config.data.source=prepared:{flags.FLAGS.out}", file=sys.stderr)


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
    config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
    flags.DEFINE_string("out", None, "Output folder (TFDS data_dir).")
    flags.DEFINE_string("tokenizer_dir", None, "Tokenizer folder; default config.init.hf_path.")
    flags.DEFINE_integer("workers", os.cpu_count() or 1, "Worker processes (<= num_shards).")
    flags.DEFINE_boolean("overwrite", False, "Replace an existing prepared dataset.")
    flags.mark_flags_as_required(["config", "out"])


if __name__ == "__main__":
    from absl import app  # pylint: disable=import-outside-toplevel
    _define_flags()
    app.run(main)
