"""The fine-tuning tasks: GLUE's table, and generic classification/regression/QA with named columns.

A ``Task`` says which text columns a row has, its labels (``labels=()`` for regression), its
metrics (``tacl_jax.finetune.metrics`` names) and, for GLUE, the Hugging Face dataset config and
splits. Labels in a file may be the class name (``"positive"``) or its index (``1``/``"1"``).
"""

from __future__ import annotations

import dataclasses

from tacl_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    kind: str                         # 'classification' | 'regression' | 'qa'
    text_column: str = "sentence"
    text_pair_column: str = ""        # '' = single sentence
    label_column: str = "label"
    labels: tuple[str, ...] = ()      # class names in index order; () for regression / QA
    metrics: tuple[str, ...] = ("accuracy",)
    hf_config: str = ""               # the 'glue' dataset's config name
    validation_splits: tuple[tuple[str, str], ...] = (("validation", ""),)   # (split, metric-key suffix)

    @property
    def num_labels(self) -> int:
        return 1 if self.kind == "regression" else len(self.labels)


def _glue(name, text, pair, labels, metrics, splits=(("validation", ""),)) -> Task:
    kind = "regression" if not labels else "classification"
    return Task(name=name, kind=kind, text_column=text, text_pair_column=pair, labels=tuple(labels),
                metrics=tuple(metrics), hf_config=name, validation_splits=splits)


# Columns, label names and metrics as the 'glue' dataset and run_glue.py have them.
GLUE: dict[str, Task] = {t.name: t for t in (
    _glue("cola", "sentence", "", ("unacceptable", "acceptable"), ("matthews_correlation",)),
    _glue("sst2", "sentence", "", ("negative", "positive"), ("accuracy",)),
    _glue("mrpc", "sentence1", "sentence2", ("not_equivalent", "equivalent"), ("accuracy", "f1")),
    _glue("qqp", "question1", "question2", ("not_duplicate", "duplicate"), ("accuracy", "f1")),
    _glue("stsb", "sentence1", "sentence2", (), ("pearson", "spearmanr")),
    # run_glue.py reports the mismatched split's metrics with an '_mm' suffix.
    _glue("mnli", "premise", "hypothesis", ("entailment", "neutral", "contradiction"), ("accuracy",),
          (("validation_matched", ""), ("validation_mismatched", "_mm"))),
    _glue("qnli", "question", "sentence", ("entailment", "not_entailment"), ("accuracy",)),
    _glue("rte", "sentence1", "sentence2", ("entailment", "not_entailment"), ("accuracy",)),
    _glue("wnli", "sentence1", "sentence2", ("not_entailment", "entailment"), ("accuracy",)),
)}
GENERIC = ("classification", "regression", "qa")


def get_task(config) -> Task:
    """The ``Task`` of ``config.task`` (a GLUE name, or 'classification'/'regression'/'qa' with
    the columns and labels of ``config.data``). A GLUE task's columns can be renamed in
    ``config.data`` too (non-empty keys win)."""
    name, d = config.task, config.data
    if name in GLUE:
        t = GLUE[name]
        renamed = {k: d[k] for k in ("text_column", "text_pair_column", "label_column") if d[k]}
        return dataclasses.replace(t, **renamed)
    if name not in GENERIC:
        raise ConfigError(f"config.task={name!r} is not a task; use one of {sorted(GLUE)} or {list(GENERIC)}")
    if name == "qa":
        return Task(name="qa", kind="qa", metrics=("exact_match", "f1"))
    labels = tuple(str(x) for x in d.label_list)
    if name == "classification" and d.label_list and len(labels) < 2:
        raise ConfigError(f"config.data.label_list={list(labels)}: a classification needs at least 2 labels")
    metrics = tuple(d.metrics) or (("pearson", "spearmanr") if name == "regression" else
                                   (("accuracy", "f1") if len(labels) == 2 else ("accuracy",)))
    return Task(name=name, kind=name, text_column=d.text_column or "sentence",
                text_pair_column=d.text_pair_column, label_column=d.label_column or "label",
                labels=labels, metrics=metrics)
