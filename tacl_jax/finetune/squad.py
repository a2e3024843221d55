"""Extractive QA in SQuAD v1.1 style: doc-stride windows, span labels, n-best decoding, EM/F1.

``features`` splits each (question, context) into windows of ``max_len`` ids that overlap by
``doc_stride`` tokens (the fast tokenizer's overflow, as run_qa.py's ``stride``); the offsets
mapping keeps each context token's character span, so an answer is labelled at its first/last
token and a decoded span is cut from the original context. Windows without the answer point at
[CLS] (index 0), as run_qa.py labels them. ``decode`` is run_qa.py's
``postprocess_qa_predictions`` (v1: no null answer); ``squad_metrics`` the official v1.1
evaluation script's normalisation, EM and F1 (percentages).
"""

from __future__ import annotations

import collections
import re
import string
from typing import Sequence

import numpy as np


def features(tok, questions: Sequence[str], contexts: Sequence[str], max_len: int, doc_stride: int,
             answer_starts: Sequence[int] | None = None, answer_texts: Sequence[str] | None = None) -> dict:
    """Windows of every example. ``tok``: a ``tokenizers.Tokenizer`` with a BERT pair post-processor.

    Returns numpy ``input_ids, attention_mask, token_type_ids [F, max_len]``, ``example_index [F]``,
    ``offsets [F, max_len, 2]`` (character span in the context; -1 where the token is not context)
    and, with answers, ``start_positions, end_positions [F]``."""
    tok.enable_truncation(max_len, stride=doc_stride, strategy="only_second")
    tok.enable_padding(length=max_len, pad_id=tok.token_to_id("[PAD]") or 0)
    try:
        encs = tok.encode_batch(list(zip([q.lstrip() for q in questions], contexts)))
    finally:
        tok.no_truncation()
        tok.no_padding()
    rows = collections.defaultdict(list)
    for i, enc in enumerate(encs):
        for w in [enc, *enc.overflowing]:
            seq = w.sequence_ids
            offs = np.array([o if s == 1 else (-1, -1) for o, s in zip(w.offsets, seq)], np.int64)
            rows["input_ids"].append(w.ids)
            rows["attention_mask"].append(w.attention_mask)
            rows["token_type_ids"].append(w.type_ids)
            rows["example_index"].append(i)
            rows["offsets"].append(offs)
            if answer_starts is not None:
                s, e = _label(offs, answer_starts[i], answer_starts[i] + len(answer_texts[i]))
                rows["start_positions"].append(s)
                rows["end_positions"].append(e)
    out = {k: np.asarray(v, np.int64 if k == "offsets" else np.int32) for k, v in rows.items()}
    return out


def _label(offs: np.ndarray, start_char: int, end_char: int) -> tuple[int, int]:
    """The first and last token of ``[start_char, end_char)`` in a window, or (0, 0) when the
    window does not hold the whole answer."""
    ctx = np.flatnonzero(offs[:, 0] >= 0)
    if ctx.size == 0 or offs[ctx[0], 0] > start_char or offs[ctx[-1], 1] < end_char:
        return 0, 0
    toks = ctx[(offs[ctx, 1] > start_char) & (offs[ctx, 0] < end_char)]
    return int(toks[0]), int(toks[-1])


def decode(start_logits: np.ndarray, end_logits: np.ndarray, feats: dict, contexts: Sequence[str],
           n_best_size: int = 20, max_answer_length: int = 30) -> list[str]:
    """The best answer text per example. ``start_logits, end_logits [F, L]``; ``feats`` from
    ``features``. Each window proposes its ``n_best_size`` best starts × ends; a span counts when both
    ends are context tokens, end >= start and it is at most ``max_answer_length`` tokens; the
    highest start+end logit over all windows of an example wins (run_qa.py's rule)."""
    best: dict[int, tuple[float, str]] = {}
    for f in range(start_logits.shape[0]):
        ex, offs = int(feats["example_index"][f]), feats["offsets"][f]
        s_idx = np.argsort(start_logits[f])[::-1][:n_best_size]
        e_idx = np.argsort(end_logits[f])[::-1][:n_best_size]
        for s in s_idx:
            for e in e_idx:
                if offs[s, 0] < 0 or offs[e, 0] < 0 or e < s or e - s + 1 > max_answer_length:
                    continue
                score = float(start_logits[f, s] + end_logits[f, e])
                if ex not in best or score > best[ex][0]:
                    best[ex] = (score, contexts[ex][offs[s, 0]:offs[e, 1]])
    return [best[i][1] if i in best else "" for i in range(len(contexts))]


# ----------------------------------------------------------------------------- official v1.1 metric

def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation, articles and extra whitespace (the official script's)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def f1(prediction: str, truth: str) -> float:
    p, t = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(p) & collections.Counter(t)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(t)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """``{'exact_match', 'f1'}`` in percent: each prediction's best over its reference answers."""
    if not predictions:
        return {"exact_match": 0.0, "f1": 0.0}
    em = [max(exact_match(p, t) for t in ts) for p, ts in zip(predictions, references)]
    f = [max(f1(p, t) for t in ts) for p, ts in zip(predictions, references)]
    return {"exact_match": 100.0 * float(np.mean(em)), "f1": 100.0 * float(np.mean(f))}
