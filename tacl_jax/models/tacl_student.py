"""TaCL's student when its teacher is another checkpoint (``tacl.teacher_hf_path``), e.g. bert-large
teaching bert-base: the student's BERT and a learned linear map of its states into the teacher's
hidden size, which the token-contrastive loss compares with the teacher's states.

Parameter tree::

    bert/...                               the student's BertModel tree (loaded from and exported to
                                           Hugging Face: the objective's ``bert_at``)
    teacher_projection/{kernel [H_s, H_t], bias [H_t]}    only when H_s != H_t

The projection is trained and checkpointed with the student (it is part of its params and
optimizer state) and never exported: the export is ``params['bert']``. It maps the student into
the teacher's space (not the teacher into the student's) so that the frozen teacher's states, the
positives and negatives, stay exactly the pretrained model's, as in TaCL with one model; the map
is the only new thing trained, initialised N(0, initializer_range) with a zero bias (TinyBERT's
``W_h``, arXiv 1909.10351, is the same map for its hidden-state loss).
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax

from tacl_jax.models.bert import BertConfig, BertModel, BertOutput, to_dtype
from tacl_jax.models.layers import Dense


class TaclStudent(nn.Module):
    """``bert`` (the student) and, when the teacher's hidden size differs, ``teacher_projection``.

    ``__call__`` is the BERT's (same arguments, same ``BertOutput``: unprojected states, so MLM and
    every other reader see the BERT alone); ``project(hidden [..., H_s]) -> [..., H_t]`` is the map
    (the identity when the sizes agree), applied by the TaCL loss to the student's anchors."""

    bert: BertModel
    teacher: BertConfig      # the teacher's architecture with the run's numerics, no heads
    # Where the Hugging Face BERT sits in this module and its params (tacl_jax.train.objective.bert_at).
    bert_at: ClassVar[str] = "bert"

    @property
    def config(self) -> BertConfig:
        """The student BERT's config (what the step reads: vocabulary, dtypes, positions)."""
        return self.bert.config

    @property
    def projects(self) -> bool:
        return self.teacher.hidden_size != self.bert.config.hidden_size

    def setup(self):
        if self.projects:
            cfg = self.bert.config
            # ('embed', 'embed_out'): the student side sharded like the encoder's outputs (fsdp), the
            # teacher side replicated; 1024 × 768 parameters at bert-large/base, a rounding error.
            self.teacher_projection = Dense((cfg.hidden_size,), (self.teacher.hidden_size,), ("embed", "embed_out"),
                                            dtype=to_dtype(cfg.dtype), param_dtype=to_dtype(cfg.param_dtype),
                                            kernel_init=nn.initializers.normal(cfg.initializer_range),
                                            kernels=cfg.kernels)

    def __call__(self, *args, **kwargs) -> BertOutput:
        out = self.bert(*args, **kwargs)
        if self.is_initializing() and self.projects:
            self.teacher_projection(out.last_hidden_state)     # creates its params in init
        return out

    def project(self, hidden: jax.Array) -> jax.Array:
        """``hidden [..., H_s]`` -> ``[..., H_t]`` in the compute dtype (the loss normalises in f32)."""
        return self.teacher_projection(hidden) if self.projects else hidden


__all__ = ["TaclStudent"]
