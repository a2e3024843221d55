"""Evaluation metrics of fine-tuning, in numpy, named as ``transformers``' run_glue.py/run_qa.py
report them (``eval_`` is prepended by the caller).

GLUE metrics are fractions in [0, 1] (as ``evaluate``'s glue metric); SQuAD's exact match and F1
are percentages (as ``evaluate``'s squad metric). Shapes: ``preds [N]`` (class ids, or floats for
regression), ``labels [N]``.
"""

from __future__ import annotations

import numpy as np


def accuracy(preds, labels) -> float:
    preds, labels = np.asarray(preds), np.asarray(labels)
    return float((preds == labels).mean()) if labels.size else 0.0


def f1_binary(preds, labels, positive: int = 1) -> float:
    """F1 of the ``positive`` class (sklearn's ``f1_score(average='binary')``; 0 when undefined)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    tp = float(np.sum((preds == positive) & (labels == positive)))
    fp = float(np.sum((preds == positive) & (labels != positive)))
    fn = float(np.sum((preds != positive) & (labels == positive)))
    return 2 * tp / (2 * tp + fp + fn) if tp > 0 else 0.0


def matthews_corrcoef(preds, labels) -> float:
    """Matthews correlation, multi-class form (sklearn's ``matthews_corrcoef``; 0 when a
    marginal is constant)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    classes = np.union1d(preds, labels)
    c = np.zeros((classes.size, classes.size), np.float64)      # c[true, pred]
    np.add.at(c, (np.searchsorted(classes, labels), np.searchsorted(classes, preds)), 1)
    t, p, n = c.sum(1), c.sum(0), c.sum()
    cov_tp = np.trace(c) * n - t @ p
    cov_pp, cov_tt = n * n - p @ p, n * n - t @ t
    if cov_pp == 0 or cov_tt == 0:
        return 0.0
    return float(cov_tp / np.sqrt(cov_tt * cov_pp))


def pearson(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denom) if denom > 0 else 0.0


def rankdata(x) -> np.ndarray:
    """Ranks 1..N with ties given their average rank (scipy's ``rankdata(method='average')``)."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Start index of each run of equal values, and each element's run.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    run = np.cumsum(np.r_[True, sorted_x[1:] != sorted_x[:-1]]) - 1
    ends = np.r_[starts[1:], x.size]
    avg = (starts + ends - 1) / 2.0 + 1.0
    ranks = np.empty(x.size, np.float64)
    ranks[order] = avg[run]
    return ranks


def spearman(x, y) -> float:
    return pearson(rankdata(x), rankdata(y))


# ----------------------------------------------------------------------------- per metric set

def compute(metric_names, preds, labels) -> dict[str, float]:
    """``{name: value}`` for ``metric_names`` (``accuracy``, ``f1``, ``matthews_correlation``,
    ``pearson``, ``spearmanr``), plus ``combined_score`` (their mean) when there are several, as
    run_glue.py reports."""
    fns = {"accuracy": accuracy, "f1": f1_binary, "matthews_correlation": matthews_corrcoef,
           "pearson": pearson, "spearmanr": spearman}
    out = {name: fns[name](preds, labels) for name in metric_names}
    if len(out) > 1:
        out["combined_score"] = float(np.mean(list(out.values())))
    return out


METRIC_NAMES = ("accuracy", "f1", "matthews_correlation", "pearson", "spearmanr")
