"""Synthetic batches: random token ids shaped like packed BERT sequences.

Clearly *not* text: the MLM task is unlearnable beyond unigram statistics. Used by benchmarks,
by tests, and by ``configs/tiny.py``.

The global batch at step ``s`` is a pure function of ``(seed, s)``; a process takes its own
contiguous block of rows, so the global batch is the same whatever the process count.
"""

from __future__ import annotations

import numpy as np


def global_batch(seed: int, step: int, batch_size: int, max_len: int, vocab_size: int,
                 first_regular_id: int, cls_id: int, sep_id: int, pad_id: int,
                 short_seq_prob: float = 0.1, with_nsp: bool = False) -> dict[str, np.ndarray]:
    """One global batch of ``[CLS] A [SEP] B [SEP] [PAD]...`` rows.

    Returns int32 arrays ``input_ids``, ``attention_mask``, ``token_type_ids``, ``word_starts``
    (all ``[batch, max_len]``) and, when ``with_nsp``, ``next_sentence_label`` ``[batch]``.
    """
    if max_len < 5:
        raise ValueError(f"max_len={max_len} is too short for [CLS] A [SEP] B [SEP]; use >= 5")
    rng = np.random.default_rng([seed, step])
    ids = np.full((batch_size, max_len), pad_id, np.int32)
    types = np.zeros((batch_size, max_len), np.int32)
    content = max_len - 3
    lengths = np.where(rng.random(batch_size) < short_seq_prob,
                       rng.integers(2, content + 1, batch_size), content)
    tokens = rng.integers(first_regular_id, vocab_size, (batch_size, content), dtype=np.int32)
    # A random ~30% of tokens continue the previous word, for whole-word masking.
    continues = rng.random((batch_size, max_len)) < 0.3
    for b in range(batch_size):
        n = int(lengths[b])
        len_a = int(rng.integers(1, n))
        row = np.concatenate([[cls_id], tokens[b, :len_a], [sep_id], tokens[b, len_a:n], [sep_id]])
        ids[b, :row.size] = row
        types[b, len_a + 2:row.size] = 1
    attention_mask = (ids != pad_id).astype(np.int32)
    special = (ids == cls_id) | (ids == sep_id) | (ids == pad_id)
    prev_special = np.concatenate([np.ones((batch_size, 1), bool), special[:, :-1]], axis=1)
    word_starts = (~special & (~continues | prev_special)).astype(np.int32)
    out = dict(input_ids=ids, attention_mask=attention_mask, token_type_ids=types,
               word_starts=word_starts)
    if with_nsp:
        out["next_sentence_label"] = rng.integers(0, 2, batch_size).astype(np.int32)
    return out


def local_batch(seed: int, step: int, batch_size: int, process_index: int, process_count: int,
                **kwargs) -> dict[str, np.ndarray]:
    """This process's rows of the global batch at ``step`` (``batch_size`` is global)."""
    if batch_size % process_count:
        raise ValueError(f"global batch {batch_size} is not divisible by {process_count} processes")
    rows = batch_size // process_count
    full = global_batch(seed, step, batch_size, **kwargs)
    return {k: v[process_index * rows:(process_index + 1) * rows] for k, v in full.items()}
