"""Global batches for training and eval: deterministic, sharded by process, resumable.

The packed rows (prepared ArrayRecord, or packed in memory when training starts) form one
infinite stream, reshuffled every epoch with seed ``seed + config.data.shuffle_seed_offset``. Global batch ``s`` is stream positions
``[s * G, (s + 1) * G)``; process ``p`` of ``P`` reads only its block of ``G / P`` rows,
``[s * G + p * G / P, s * G + (p + 1) * G / P)``. Hence:

- the batch at step ``s`` is a pure function of ``(seed, s)`` and the data;
- the processes' rows are disjoint and together form the global batch, in process order, so the
  global batch is the same for any process count (``jax.make_array_from_process_local_data``
  stacks the blocks in process order);
- the iterator state is just the step: a resumed run sees exactly the batches an uninterrupted
  run would, even with another process count or worker count.

Why not ``grain.IndexSampler(shard_options=ShardByJaxProcess())``: it splits the *records* between
processes before shuffling, so the global batch would change with the process count. We use the
grain ``MapDataset`` of steps (``ReadOptions`` threads and prefetch, ``mp_prefetch`` worker
processes) whose map function reads the process's block of the global batch
(:class:`ShuffledBatches`).

Batch dict (int32 numpy, ``rows = global_batch_size // process_count``):
  ``input_ids``, ``attention_mask``, ``token_type_ids``, ``word_starts`` ``[rows, max_len]`` and,
  with ``with_nsp``, ``next_sentence_label`` ``[rows]`` (1 = B is a random span).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Sequence

import grain
from absl import flags
import ml_collections
import numpy as np

from tacl_jax.data import config as data_config_lib
from tacl_jax.data import corpus
from tacl_jax.data import packing
from tacl_jax.data import sources
from tacl_jax.data import synthetic
from tacl_jax.data import tfds_builder
from tacl_jax.data import tokenization

_SYNTHETIC_EVAL_SEED = 0x5EED  # Eval batches of 'synthetic' use seed + this.


# --------------------------------------------------------------------------------------------------
# Rows -> batch.


def collate(rows: Sequence[packing.Row], *, max_len: int, pad_id: int,
            with_nsp: bool) -> dict[str, np.ndarray]:
    """Pads packed rows into a batch dict (see module doc); rows are at most ``max_len`` long."""
    n = len(rows)
    input_ids = np.full((n, max_len), pad_id, np.int32)
    word_starts = np.zeros((n, max_len), np.int32)
    token_type_ids = np.zeros((n, max_len), np.int32)
    lengths = np.empty(n, np.int32)
    for r, row in enumerate(rows):
        k = len(row.input_ids)
        if k > max_len:
            raise ValueError(f"a packed row has {k} tokens, more than max_len={max_len}: the data "
                             "was packed for a longer max_len")
        input_ids[r, :k] = row.input_ids
        word_starts[r, :k] = row.word_starts
        token_type_ids[r, row.segment_a_len:k] = 1
        lengths[r] = k
    batch = dict(input_ids=input_ids,
                 attention_mask=(np.arange(max_len)[None, :] < lengths[:, None]).astype(np.int32),
                 token_type_ids=token_type_ids, word_starts=word_starts)
    if with_nsp:
        batch["next_sentence_label"] = np.fromiter((row.next_sentence_label for row in rows),
                                                   np.int32, n)
    return batch


def _synthetic_batch(step: int, **kwargs) -> dict[str, np.ndarray]:
    return synthetic.local_batch(step=int(step), **kwargs)


class ShuffledBatches:
    """``step -> this process's batch dict``: the grain map function of the training pipeline.

    Stream position ``i`` is row ``perm(i // N)[i % N]`` of the ``N`` rows, with ``perm(e)`` a
    permutation seeded by ``(seed, e)``: every epoch is a new shuffle of all rows. Batches are read
    with one batched ``__getitems__`` call. (grain's ``MapDataset.shuffle`` gives the same kind of
    stream but costs ~30 us of Python per row; a numpy permutation per epoch is ~10 ns per row.)
    """

    def __init__(self, rows, *, seed: int, global_batch_size: int, process_index: int,
                 process_count: int, collate_fn):
        self.rows = rows
        self.seed = int(seed)
        self.global_batch_size = global_batch_size
        self.rows_per_process = global_batch_size // process_count
        self.offset = process_index * self.rows_per_process
        self.collate_fn = collate_fn
        self._perms: dict[int, np.ndarray] = {}

    def __getstate__(self):  # Worker processes rebuild the permutations they need.
        return dict(self.__dict__, _perms={})

    def permutation(self, epoch: int) -> np.ndarray:
        """The row order of ``epoch``, int64 ``[N]``; the last two epochs are cached."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def indices(self, step: int) -> np.ndarray:
        """Row indices of this process's part of global batch ``step``, int64 ``[rows]``."""
        n = len(self.rows)
        start = int(step) * self.global_batch_size + self.offset
        positions = np.arange(start, start + self.rows_per_process, dtype=np.int64)
        epochs, within = np.divmod(positions, n)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):  # A batch can straddle two epochs.
            sel = epochs == epoch
            out[sel] = self.permutation(int(epoch))[within[sel]]
        return out

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        return self.collate_fn(self.rows.__getitems__(self.indices(step).tolist()))


# --------------------------------------------------------------------------------------------------
# Sources of rows.


@functools.lru_cache(maxsize=2)
def _pack_in_memory(data_json: str, max_len: int, tokenizer_dir: str,
                    special_ids_json: str) -> tuple[dict, dict]:
    """Tokenizes and packs both splits of a text source once per process (train and eval share)."""
    data_config = ml_collections.ConfigDict(json.loads(data_json))
    special_ids = json.loads(special_ids_json)
    source = sources.open_source(data_config)
    encoder = tokenization.SentenceEncoder(tokenization.load_tokenizer(tokenizer_dir))
    spec = corpus.PackSpec.from_config(data_config, max_len=max_len, special_ids=special_ids)
    rows, counts = {}, {}
    for split in corpus.SPLITS:
        if split == "validation" and spec.eval_fraction <= 0:
            rows[split], counts[split] = packing.PackedRows.concatenate([]), {}
            continue
        results = corpus.pack_shards(source, encoder, spec, split)
        rows[split] = packing.PackedRows.concatenate([r.rows for r in results])
        counts[split] = corpus.report(source.description, split, results)
    if counts["train"]["documents"] == 0:
        raise ValueError(
            f"config.data.source={data_config.source!r}: {source.description} has no non-empty "
            "document to train on (empty files? a .jsonl text_field that is always empty? "
            "everything held out by eval_fraction?). Point the source at a real corpus.")
    return rows, counts


def _check_prepared(meta: dict, path: str, *, max_len: int, vocab_size: int, special_ids: dict,
                    tokenizer_dir: str | None) -> None:
    """Refuses a prepared dataset made for another max_len or vocabulary."""
    fix = "re-run `python -m tacl_jax.data.prepare` with this run's config and tokenizer"
    if meta.get("max_len") != max_len:
        raise ValueError(f"{path} was prepared for max_len={meta.get('max_len')}, but this run has "
                         f"max_len={max_len}: {fix}")
    theirs = {k: meta.get("special_ids", {}).get(k) for k in tokenization.SPECIAL_KEYS}
    ours = {k: special_ids.get(k) for k in tokenization.SPECIAL_KEYS}
    if theirs != ours:
        raise ValueError(f"{path} was tokenized with special ids {theirs}, the model uses {ours}: "
                         f"{fix}")
    if meta.get("tokenizer_vocab_size", 0) > vocab_size:
        raise ValueError(f"{path} was tokenized with a {meta['tokenizer_vocab_size']}-token "
                         f"vocabulary, larger than the model's vocab_size={vocab_size}: {fix}")
    if tokenizer_dir:
        fingerprint = tokenization.vocab_fingerprint(tokenization.load_tokenizer(tokenizer_dir))
        if fingerprint != meta.get("vocab_fingerprint"):
            raise ValueError(f"{path} was tokenized with another vocabulary than the one in "
                             f"{tokenizer_dir!r} (fingerprint {meta.get('vocab_fingerprint')} vs "
                             f"{fingerprint}): {fix}")


def open_rows(data_config: ml_collections.ConfigDict, split: str, *, max_len: int,
              tokenizer_dir: str | None, vocab_size: int, special_ids: dict, with_nsp: bool):
    """The packed rows of ``split`` (a grain random-access source of :data:`packing.Row`) and the
    dataset's description, after checking the data matches the model."""
    data_config_lib.validate(data_config)
    kind, arg = sources.parse_source(data_config.source)
    if kind == "prepared":
        rows = tfds_builder.PreparedRows(arg, split)
        _check_prepared(rows.metadata, rows.path, max_len=max_len, vocab_size=vocab_size,
                        special_ids=special_ids, tokenizer_dir=tokenizer_dir)
        packing_mode = rows.metadata.get("packing")
        description = f"prepared {rows.path}"
    else:
        sources.open_source(data_config)  # Fail fast (missing files) before loading a tokenizer.
        tok = tokenization.load_tokenizer(tokenizer_dir)
        tokenization.check_tokenizer(tok, vocab_size=vocab_size, special_ids=special_ids,
                                     tokenizer_dir=tokenizer_dir)
        all_rows, _ = _pack_in_memory(json.dumps(data_config.to_dict(), sort_keys=True),
                                      int(max_len), tokenizer_dir,
                                      json.dumps(special_ids, sort_keys=True))
        rows = all_rows[split]
        packing_mode = data_config.packing
        description = data_config.source
    if with_nsp and packing_mode != "nsp_pairs":
        raise ValueError(f"next-sentence prediction is on, but {description} is packed as "
                         f"{packing_mode!r}: set config.data.packing='nsp_pairs' (and re-run "
                         "prepare for a prepared source), or turn NSP off")
    return rows, description


# --------------------------------------------------------------------------------------------------
# Iterators.


class TrainIterator:
    """Iterator over this process's rows of global batch 0, 1, 2, ... (see module doc).

    ``next()`` returns the batch dict of the current step and advances; ``get_state()`` is
    ``{'step': s, ...}`` (JSON), and ``set_state`` restarts the pipeline at that step. The extra
    keys identify the data; a restore that does not match them logs a warning and proceeds.
    """

    def __init__(self, step_dataset: grain.MapDataset, *, read_options: grain.ReadOptions,
                 worker_count: int, identity: dict):
        self._steps = step_dataset
        self._read_options = read_options
        self._worker_count = worker_count
        self.identity = identity
        self._step = 0
        self._it = None

    @property
    def step(self) -> int:
        """The step of the batch the next ``next()`` returns."""
        return self._step

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._it is None:
            if self._worker_count and not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (defaults here).
            ds = self._steps[self._step:].to_iter_dataset(self._read_options)
            if self._worker_count:
                ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._worker_count))
            self._it = iter(ds)
        batch = next(self._it)
        self._step += 1
        return batch

    def get_state(self) -> dict:
        return dict(self.identity, step=self._step)

    def set_state(self, state: dict) -> None:
        changed = {k: (state.get(k), v) for k, v in self.identity.items() if state.get(k) != v}
        if changed:
            logging.warning("restoring the data iterator at step %s with other data settings "
                            "(saved vs now: %s): the batches differ from the interrupted run's",
                            state.get("step"), changed)
        self.close()
        self._step = int(state["step"])

    def close(self) -> None:
        """Stops worker processes, if any; the next ``next()`` restarts the pipeline."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None


def _check_layout(global_batch_size: int, process_index: int, process_count: int) -> int:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                         f"the process count {process_count}")
    return global_batch_size // process_count


def _synthetic_kwargs(data_config, *, global_batch_size, max_len, process_index, process_count,
                      vocab_size, special_ids, with_nsp) -> dict:
    first = data_config.first_regular_id
    if first < 0:
        first = 999 if vocab_size > 2000 else 5
    return dict(batch_size=global_batch_size, process_index=process_index,
                process_count=process_count, max_len=max_len, vocab_size=vocab_size,
                first_regular_id=first, cls_id=special_ids["cls"], sep_id=special_ids["sep"],
                pad_id=special_ids["pad"], short_seq_prob=data_config.short_seq_prob,
                with_nsp=with_nsp)


def make_train_iterator(data_config: ml_collections.ConfigDict, *, global_batch_size: int,
                        max_len: int, seed: int, process_index: int, process_count: int,
                        tokenizer_dir: str | None, vocab_size: int, special_ids: dict,
                        with_nsp: bool) -> TrainIterator:
    """This process's rows of every global training batch, from step 0 (see module doc).

    Args:
      data_config: ``config.data`` (:func:`tacl_jax.data.config.default_config`).
      global_batch_size: rows per step over all processes; divisible by ``process_count``.
      max_len: row length; a prepared dataset must have been packed for it.
      seed: the run's seed (plus ``data_config.shuffle_seed_offset``) seeds the shuffle.
      process_index, process_count: ``jax.process_index()``, ``jax.process_count()``.
      tokenizer_dir: the run's tokenizer folder (text sources; checks prepared data); may be
        None for 'synthetic' and 'prepared:'.
      vocab_size: the model's vocabulary size; the tokenizer must not exceed it.
      special_ids: the model's ``pad cls sep mask unk`` ids; must equal the tokenizer's.
      with_nsp: add ``next_sentence_label``; needs ``packing='nsp_pairs'``.

    Returns:
      A :class:`TrainIterator` of dicts of int32 arrays ``[global_batch_size // process_count,
      max_len]`` (``next_sentence_label``: ``[rows]``).
    """
    _check_layout(global_batch_size, process_index, process_count)   # raises on a bad layout
    data_config_lib.validate(data_config)
    read_options = grain.ReadOptions(num_threads=data_config.read_threads,
                                     prefetch_buffer_size=data_config.prefetch)
    identity = dict(source=data_config.source, seed=int(seed),
                    shuffle_seed_offset=int(data_config.shuffle_seed_offset),
                    global_batch_size=int(global_batch_size), max_len=int(max_len))
    if sources.parse_source(data_config.source)[0] == "synthetic":
        kwargs = _synthetic_kwargs(data_config, global_batch_size=global_batch_size,
                                   max_len=max_len, process_index=process_index,
                                   process_count=process_count, vocab_size=vocab_size,
                                   special_ids=special_ids, with_nsp=with_nsp)
        steps = grain.MapDataset.range(sys.maxsize).map(
            functools.partial(_synthetic_batch, seed=int(seed), **kwargs))
        return TrainIterator(steps, read_options=read_options,
                             worker_count=data_config.worker_count, identity=identity)

    rows, description = open_rows(data_config, "train", max_len=max_len,
                                  tokenizer_dir=tokenizer_dir, vocab_size=vocab_size,
                                  special_ids=special_ids, with_nsp=with_nsp)
    if len(rows) < global_batch_size:
        raise ValueError(
            f"{description} packs into {len(rows)} training rows of max_len={max_len}, fewer than "
            f"one global batch of {global_batch_size}: use a larger corpus, or lower "
            "global_batch_size or max_len")
    identity["num_rows"] = len(rows)
    batches = ShuffledBatches(
        rows, seed=(int(seed) + int(data_config.shuffle_seed_offset)) % 2**32,
        global_batch_size=global_batch_size, process_index=process_index,
        process_count=process_count, collate_fn=functools.partial(
            collate, max_len=max_len, pad_id=special_ids["pad"], with_nsp=with_nsp))
    steps = grain.MapDataset.range(sys.maxsize).map(batches)
    logging.info("training data: %s, %d rows, %.1f steps per epoch", description, len(rows),
                 len(rows) / global_batch_size)
    return TrainIterator(steps, read_options=read_options, worker_count=data_config.worker_count,
                         identity=identity)


def make_eval_batches(data_config: ml_collections.ConfigDict, *, global_batch_size: int,
                      max_len: int, seed: int, process_index: int, process_count: int,
                      tokenizer_dir: str | None, vocab_size: int, special_ids: dict,
                      with_nsp: bool, num_batches: int) -> list[dict[str, np.ndarray]]:
    """This process's rows of the first ``num_batches`` global batches of the held-out split.

    Fixed order (no shuffle): batch ``b`` is held-out rows ``[b * G, (b + 1) * G)``, split between
    processes as in training. Returns fewer batches (with a warning) if the split is smaller;
    raises ValueError if it has less than one global batch. Arguments as
    :func:`make_train_iterator`; ``seed`` only matters for 'synthetic'.
    """
    rows_per_process = _check_layout(global_batch_size, process_index, process_count)
    data_config_lib.validate(data_config)
    if sources.parse_source(data_config.source)[0] == "synthetic":
        kwargs = _synthetic_kwargs(data_config, global_batch_size=global_batch_size,
                                   max_len=max_len, process_index=process_index,
                                   process_count=process_count, vocab_size=vocab_size,
                                   special_ids=special_ids, with_nsp=with_nsp)
        return [_synthetic_batch(b, seed=int(seed) + _SYNTHETIC_EVAL_SEED, **kwargs)
                for b in range(num_batches)]
    rows, description = open_rows(data_config, "validation", max_len=max_len,
                                  tokenizer_dir=tokenizer_dir, vocab_size=vocab_size,
                                  special_ids=special_ids, with_nsp=with_nsp)
    available = len(rows) // global_batch_size
    if available == 0:
        raise ValueError(
            f"the held-out split of {description} has {len(rows)} rows, fewer than one global "
            f"batch of {global_batch_size}: raise config.data.eval_fraction (now "
            f"{data_config.eval_fraction}; for a prepared source re-run prepare), use a larger "
            "corpus, or lower the batch size")
    if available < num_batches:
        logging.warning("the held-out split of %s has %d global batches, not %d: evaluating on %d",
                        description, available, num_batches, available)
    out = []
    for b in range(min(num_batches, available)):
        start = b * global_batch_size + process_index * rows_per_process
        out.append(collate(rows.__getitems__(range(start, start + rows_per_process)),
                           max_len=max_len, pad_id=special_ids["pad"], with_nsp=with_nsp))
    return out
