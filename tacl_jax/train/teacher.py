"""A TaCL teacher that is another checkpoint than the student's init (``tacl.teacher_hf_path``).

By default TaCL's teacher is the student's own initial encoder (``setup.create_teacher``). With
``tacl.teacher_hf_path`` it is a Hugging Face BERT of any size with the student's vocabulary
(bert-large teaching bert-base): its architecture comes from that folder's config.json with the
run's numerics (``BertConfig.NUMERIC_FIELDS``: dtypes, kernels, layout), its weights from the
folder; the student gets ``models.tacl_student.TaclStudent``'s learned projection when the hidden
sizes differ. The teacher is sharded by the same logical-axis rules as the student, is rebuilt
from the folder at every start (never checkpointed) and never receives a gradient.

A different vocabulary is refused: TaCL's positive for a student token is the teacher's state at
the same position of the same ids, so both must read the same token sequence.
"""

from __future__ import annotations

import logging

from tacl_jax import hf
from tacl_jax.errors import ConfigError
from tacl_jax.models.bert import NUMERIC_FIELDS, BertConfig

log = logging.getLogger(__name__)


def teacher_path(config) -> str:
    """The run's separate teacher checkpoint, or '' (the teacher is the student's initial encoder)."""
    return config.tacl.get("teacher_hf_path", "") if config.objective == "tacl" else ""


def teacher_config(config, student: BertConfig) -> BertConfig:
    """The teacher's ``BertConfig``: ``tacl.teacher_hf_path``'s architecture with the student's
    numerics, no heads. Raises ``ConfigError`` when its vocabulary size is not the student's."""
    path = teacher_path(config)
    arch = hf.read_config(path)
    if arch.vocab_size != student.vocab_size:
        raise ConfigError(
            f"tacl.teacher_hf_path={path!r} has vocab_size {arch.vocab_size} but the student has "
            f"{student.vocab_size}: TaCL compares the two models' states at the same token ids, so the "
            "teacher must use the student's tokenizer; pick a teacher of the same family (e.g. "
            "bert-large-uncased for bert-base-uncased)")
    numerics = {name: getattr(student, name) for name in NUMERIC_FIELDS}
    return arch.replace(**numerics, with_mlm_head=False, with_pooler=False, with_nsp_head=False)


def check_same_tokenizer(config) -> None:
    """Refuses (``ConfigError``) a teacher whose folder carries a tokenizer with another vocabulary
    than the run's. A folder without tokenizer files is accepted on its vocab_size alone (checked
    by ``teacher_config``), with a log line."""
    from tacl_jax.data import tokenization

    path, student_tok = teacher_path(config), config.init.tokenizer_path or config.init.hf_path
    try:
        teacher = tokenization.load_tokenizer(path)
    except FileNotFoundError:
        log.info("tacl.teacher_hf_path=%s has no tokenizer files: its vocabulary is checked by size only", path)
        return
    if not student_tok:
        return       # synthetic ids: no tokenizer to compare with
    student = tokenization.load_tokenizer(student_tok)
    a, b = tokenization.vocab_fingerprint(student), tokenization.vocab_fingerprint(teacher)
    if a != b:
        raise ConfigError(
            f"the teacher's tokenizer ({path!r}, vocabulary {b}) differs from the run's ({student_tok!r}, "
            f"vocabulary {a}): TaCL needs both models to read the same token ids; use a teacher trained "
            "with the student's tokenizer, or set config.init.tokenizer_path to the one they share")


def teacher_params(config, teacher: BertConfig, seed: int) -> dict:
    """The teacher's encoder params (host numpy: ``embeddings``, ``encoder``) from
    ``tacl.teacher_hf_path``, in the layout ``teacher`` (the teacher module's config) asks for."""
    check_same_tokenizer(config)
    path = teacher_path(config)
    fields = {name: getattr(teacher, name) for name in NUMERIC_FIELDS}
    _, params = hf.load(path, seed=seed, with_mlm_head=False, with_pooler=False, with_nsp_head=False, **fields)
    log.info("teacher: %s (%d layers, hidden %d)", path, teacher.num_hidden_layers, teacher.hidden_size)
    return {k: v for k, v in params.items() if k in ("embeddings", "encoder")}


__all__ = ["teacher_path", "teacher_config", "check_same_tokenizer", "teacher_params"]
