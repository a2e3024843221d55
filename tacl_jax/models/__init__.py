"""The Flax BERT used for the student, the teacher and the MLM baseline."""

from tacl_jax.models.bert import (BertConfig, BertModel, BertOutput, REMAT_POLICIES, stack_layers, to_dtype,
                                  unstack_layers)

__all__ = ["BertConfig", "BertModel", "BertOutput", "REMAT_POLICIES", "stack_layers", "to_dtype",
           "unstack_layers"]
