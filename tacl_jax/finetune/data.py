"""Fine-tuning data: rows from local CSV/TSV/JSONL files or the Hugging Face ``datasets`` cache,
labels checked against the task, text tokenized into fixed-length rows, and the batch order.

Files: ``.csv`` (comma, a header row), ``.tsv`` (tab, a header row, no quoting: GLUE's TSVs),
``.jsonl`` / ``.json`` (one object per line). ``datasets`` is optional: it is imported only for
``data.hf_dataset`` and reads only what is already in its cache (``HF_DATASETS_OFFLINE=1``).

Encoded arrays (numpy, N rows): ``input_ids, attention_mask, token_type_ids [N, max_len]`` int32
and ``labels [N]`` (int32 class ids; float32 for regression).
"""

from __future__ import annotations

import csv
import json
import os
from typing import Sequence

import numpy as np

from tacl_jax.errors import UserError


class DataError(UserError, ValueError):
    """Unreadable or inconsistent fine-tuning data; the message names the file/column and the fix."""


# ----------------------------------------------------------------------------- reading

def read_rows(path: str) -> list[dict]:
    """All rows of a local ``.csv``/``.tsv``/``.jsonl``/``.json`` file as dicts (column -> value)."""
    if not os.path.isfile(path):
        raise DataError(f"data file {path!r} does not exist; set config.data.train_file / "
                        "data.validation_file to an existing .csv, .tsv or .jsonl file")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{n} is not JSON ({e.msg}); a .jsonl file holds one "
                                        "JSON object per line") from None
        return rows
    if ext in (".csv", ".tsv"):
        csv.field_size_limit(1 << 30)
        with open(path, encoding="utf-8", newline="") as f:
            if ext == ".tsv":   # GLUE's TSVs have stray quotes inside fields: no quoting
                return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
            return list(csv.DictReader(f))
    raise DataError(f"data file {path!r}: unknown format {ext!r}; use .csv, .tsv or .jsonl")


def read_hf_split(name: str, config_name: str, split: str) -> list[dict]:
    """Rows of a split of a Hugging Face dataset that is already in the ``datasets`` cache."""
    fix = (f"or export the split to JSONL on a machine that has it (datasets.load_dataset({name!r}"
           f"{', ' + repr(config_name) if config_name else ''})['{split}'].to_json('{split}.jsonl')) and "
           "pass data.train_file / data.validation_file")
    try:
        import datasets  # pylint: disable=import-outside-toplevel  (optional dependency)
    except ImportError:
        raise DataError(f"data.hf_dataset={name!r} needs the `datasets` package, which is not installed: "
                        f"pip install datasets (with the data in its cache), {fix}") from None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # the cache only: never a download at run time
    try:
        ds = datasets.load_dataset(name, config_name or None, split=split)
    except Exception as e:  # pylint: disable=broad-except  # ConnectionError, FileNotFoundError, ValueError...
        raise DataError(f"data.hf_dataset={name!r} ({config_name or 'default'}, split {split!r}) is not in the "
                        f"Hugging Face datasets cache ({type(e).__name__}: {str(e)[:160]}); cache it "
                        f"online first, {fix}") from None
    return [dict(r) for r in ds]


def load_split(data_cfg, split: str, file_key: str) -> list[dict]:
    """Rows of ``split``: ``data[file_key]`` when set, else the ``data.hf_dataset`` split."""
    path = data_cfg[file_key]
    if path:
        return read_rows(os.path.expanduser(path))
    if data_cfg.hf_dataset:
        return read_hf_split(data_cfg.hf_dataset, data_cfg.hf_config, split)
    raise DataError(f"no {split} data: set config.data.{file_key} (a .csv/.tsv/.jsonl file) or "
                    "config.data.hf_dataset (and data.hf_config) for the Hugging Face datasets cache")


def check_columns(rows: Sequence[dict], columns: Sequence[str], where: str) -> None:
    if not rows:
        raise DataError(f"{where} has no rows")
    missing = [c for c in columns if c and c not in rows[0]]
    if missing:
        raise DataError(f"{where} has no column {missing[0]!r} (it has {sorted(rows[0])}); set the "
                        "column names in config.data (text_column, text_pair_column, label_column, "
                        "question_column, context_column, answers_column)")


# ----------------------------------------------------------------------------- labels

def infer_labels(rows: Sequence[dict], column: str) -> tuple[str, ...]:
    """Distinct label values of the training rows, sorted (numbers numerically)."""
    values = {str(r[column]) for r in rows}
    try:
        return tuple(sorted(values, key=float))
    except ValueError:
        return tuple(sorted(values))


def label_ids(rows: Sequence[dict], task, where: str) -> np.ndarray:
    """``[N]`` labels: float32 for regression, else class indices (a value may be a class name of
    ``task.labels`` or an index). A label of -1 (GLUE's hidden test labels) is kept as -1."""
    col = task.label_column
    if task.kind == "regression":
        try:
            return np.asarray([float(r[col]) for r in rows], np.float32)
        except (TypeError, ValueError) as e:
            raise DataError(f"{where}: column {col!r} holds a non-number ({e}); a regression needs numeric labels") \
                from None
    index = {name: i for i, name in enumerate(task.labels)}
    out = np.empty(len(rows), np.int32)
    for n, r in enumerate(rows):
        v = r[col]
        s = str(v).strip()
        if s in index:
            out[n] = index[s]
        elif s.lstrip("-").isdigit() and (int(s) == -1 or 0 <= int(s) < len(task.labels)):
            out[n] = int(s)
        else:
            raise DataError(f"{where}: row {n} has label {v!r}, not one of {list(task.labels)} (names or "
                            "indices); set config.data.label_list to the task's labels")
    return out


# ----------------------------------------------------------------------------- encoding

def encode_texts(tok, texts: Sequence[str], pairs: Sequence[str] | None, max_len: int) -> dict[str, np.ndarray]:
    """Sentences (or pairs) -> ``[CLS] a [SEP] (b [SEP])`` padded/truncated to ``max_len``
    (longest-first truncation, as ``transformers``' tokenizer with ``truncation=True``)."""
    tok.enable_truncation(max_len, strategy="longest_first")
    tok.enable_padding(length=max_len, pad_id=tok.token_to_id("[PAD]") or 0)
    try:
        inputs = list(zip(texts, pairs)) if pairs is not None else list(texts)
        encs = tok.encode_batch(inputs)
    finally:
        tok.no_truncation()
        tok.no_padding()
    return {"input_ids": np.asarray([e.ids for e in encs], np.int32),
            "attention_mask": np.asarray([e.attention_mask for e in encs], np.int32),
            "token_type_ids": np.asarray([e.type_ids for e in encs], np.int32)}


def encode_classification(tok, rows: Sequence[dict], task, max_len: int, where: str) -> dict[str, np.ndarray]:
    """Rows of a classification/regression task -> the encoded arrays with ``labels``; rows whose
    label is -1 (unlabelled) are dropped."""
    check_columns(rows, [task.text_column, task.text_pair_column, task.label_column], where)
    labels = label_ids(rows, task, where)
    keep = np.flatnonzero(labels != -1) if task.kind != "regression" else np.arange(len(rows))
    rows = [rows[i] for i in keep]
    texts = [str(r[task.text_column]) for r in rows]
    pairs = [str(r[task.text_pair_column]) for r in rows] if task.text_pair_column else None
    return {**encode_texts(tok, texts, pairs, max_len), "labels": labels[keep]}


def qa_examples(rows: Sequence[dict], data_cfg, where: str) -> dict[str, list]:
    """SQuAD-style rows (``answers = {'text': [...], 'answer_start': [...]}``, as the 'squad'
    dataset) -> ``{'question', 'context', 'answer_texts' (all references), 'answer_start',
    'answer_text' (the first, for training)}``."""
    q, c, a = data_cfg.question_column, data_cfg.context_column, data_cfg.answers_column
    check_columns(rows, [q, c, a], where)
    out = {"question": [], "context": [], "answer_texts": [], "answer_start": [], "answer_text": []}
    for n, r in enumerate(rows):
        ans = r[a]
        if isinstance(ans, str):
            ans = json.loads(ans)   # a CSV cell holding the JSON object
        if not ans.get("text"):
            raise DataError(f"{where}: row {n} has no answer; SQuAD v1.1 rows need answers.text and "
                            "answers.answer_start")
        out["question"].append(str(r[q]))
        out["context"].append(str(r[c]))
        out["answer_texts"].append([str(t) for t in ans["text"]])
        out["answer_start"].append(int(ans["answer_start"][0]))
        out["answer_text"].append(str(ans["text"][0]))
    return out


# ----------------------------------------------------------------------------- order

def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The training rows' order in ``epoch``: a permutation that is a pure function of (seed,
    epoch), so a resumed run sees the same batches."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def train_batch_indices(num_rows: int, batch: int, seed: int, step: int) -> np.ndarray:
    """Row indices of training step ``step`` (0-based) ``[batch]``: epochs of ``num_rows // batch``
    full batches (the incomplete last batch of an epoch is dropped: static shapes)."""
    per_epoch = num_rows // batch
    epoch, i = divmod(step, per_epoch)
    return epoch_order(num_rows, seed, epoch)[i * batch:(i + 1) * batch]


def eval_batches(arrays: dict[str, np.ndarray], batch: int):
    """``arrays`` in order as batches of ``batch`` rows; the last one padded with copies of row 0
    whose ``weights`` are 0. Yields ``(batch dict with weights [batch], number of real rows)``."""
    n = len(next(iter(arrays.values())))
    for start in range(0, n, batch):
        idx = np.arange(start, min(start + batch, n))
        real = idx.size
        idx = np.concatenate([idx, np.zeros(batch - real, idx.dtype)])
        b = {k: v[idx] for k, v in arrays.items()}
        b["weights"] = (np.arange(batch) < real).astype(np.float32)
        yield b, real
