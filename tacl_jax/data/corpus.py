"""From a document source to packed rows: split, sentence-split, tokenize, pack, per shard.

Documents are dealt to ``num_shards`` shards round-robin by index and each shard is packed on its
own, with its own random stream ``(PACK_SEED, split, shard)``. So the rows depend only on the corpus,
the tokenizer and the :class:`PackSpec` -- not on how many processes did the work: ``prepare`` with
8 workers and on-the-fly packing in one process give identical rows.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from tacl_jax.data import packing
from tacl_jax.data import preprocess
from tacl_jax.data import sources
from tacl_jax.data import tokenization

PACK_SEED = 0x7AC1  # Fixed: packing randomness is part of the dataset, not of the run's seed.
SPLITS = ("train", "validation")
_SENTENCES_PER_ENCODE = 8192  # Documents are tokenized in batches of about this many sentences.


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """Everything besides corpus and tokenizer that determines the rows."""
    packing: str
    max_len: int
    short_seq_prob: float
    eval_fraction: float
    num_shards: int
    cls_id: int
    sep_id: int

    @classmethod
    def from_config(cls, data_config, *, max_len: int, special_ids: dict) -> PackSpec:
        return cls(packing=data_config.packing, max_len=int(max_len),
                   short_seq_prob=float(data_config.short_seq_prob),
                   eval_fraction=float(data_config.eval_fraction),
                   num_shards=int(data_config.num_shards),
                   cls_id=int(special_ids["cls"]), sep_id=int(special_ids["sep"]))


@dataclasses.dataclass
class ShardResult:
    """One shard of one split: its rows and counts."""
    rows: packing.PackedRows
    documents: int = 0
    tokens: int = 0  # Corpus tokens, without the specials the packer adds.
    cut_sentences: int = 0  # Sentences longer than a row, cut into pieces.
    replaced_bytes: int = 0  # Undecodable bytes replaced while reading (counted in shard 0 only).


def pack_shards(source: sources.DocumentSource, encoder: tokenization.SentenceEncoder,
                spec: PackSpec, split: str, shards: list[int] | None = None) -> list[ShardResult]:
    """Packs the given shards (default: all) of ``split`` in one pass over the source.

    Returns one :class:`ShardResult` per requested shard, in the requested order.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: use one of {SPLITS}")
    shards = list(range(spec.num_shards)) if shards is None else list(shards)
    packers = {
        k: packing.make_packer(
            spec.packing, max_len=spec.max_len, cls_id=spec.cls_id, sep_id=spec.sep_id,
            short_seq_prob=spec.short_seq_prob,
            rng=np.random.default_rng([PACK_SEED, SPLITS.index(split), k]))
        for k in shards}
    if len(shards) == 1:
        stream = source.documents(shards[0], spec.num_shards)
    else:
        stream = ((i, d) for i, d in source.documents(0, 1) if i % spec.num_shards in packers)
    want_eval = split == "validation"
    replaced_before = source.stats.replaced_bytes

    pending: list[tuple[int, list[str]]] = []  # (shard, sentences) waiting to be tokenized.
    num_sentences = 0

    def flush():
        texts = [s for _, sentences in pending for s in sentences]
        encoded = encoder.encode(texts)
        pos = 0
        for shard, sentences in pending:
            packers[shard].add_document(encoded[pos:pos + len(sentences)])
            pos += len(sentences)
        pending.clear()

    for doc_index, lines in stream:
        if preprocess.is_eval_document(doc_index, spec.eval_fraction) != want_eval:
            continue
        sentences = [s for line in lines for s in preprocess.split_sentences(line)]
        pending.append((doc_index % spec.num_shards, sentences))
        num_sentences += len(sentences)
        if num_sentences >= _SENTENCES_PER_ENCODE:
            flush()
            num_sentences = 0
    flush()
    results = []
    for k in shards:
        p = packers[k]
        results.append(ShardResult(rows=p.finish(), documents=p.num_documents, tokens=p.num_tokens,
                                   cut_sentences=p.num_cut_sentences))
        if k == 0:  # Sources count repairs while reading shard 0 (which reads every file).
            results[-1].replaced_bytes = source.stats.replaced_bytes - replaced_before
    return results


def report(description: str, split: str, results: list[ShardResult]) -> dict:
    """Logs and returns the counts of a packed split."""
    counts = dict(documents=sum(r.documents for r in results),
                  tokens=sum(r.tokens for r in results),
                  rows=sum(len(r.rows) for r in results),
                  cut_sentences=sum(r.cut_sentences for r in results),
                  replaced_bytes=sum(r.replaced_bytes for r in results))
    logging.info("%s, split %s: %d documents, %d tokens, %d rows", description, split,
                 counts["documents"], counts["tokens"], counts["rows"])
    if counts["cut_sentences"]:
        logging.warning("%s: %d sentences were longer than a row and were cut into row-sized "
                        "pieces (text without sentence punctuation or line breaks?)",
                        description, counts["cut_sentences"])
    return counts
