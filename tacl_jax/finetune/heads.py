"""Fine-tuning heads on ``tacl_jax.models.BertModel``, as Hugging Face's classes compute them.

* ``SequenceClassifier``, per ``config.model_type`` as the family's own class:
  - ``'bert'`` = ``BertForSequenceClassification``: pooler ([CLS] -> Dense -> tanh, the BERT's
    own) -> dropout -> ``classifier`` Dense ``[H, num_labels]``;
  - ``'roberta'`` / ``'electra'`` = ``RobertaForSequenceClassification`` /
    ``ElectraForSequenceClassification``: no pooler (RoBERTa's checkpoints carry one MLM never
    trained; ELECTRA has none); the first token's last hidden state -> dropout ->
    ``classifier/dense`` ``[H, H]`` -> tanh (RoBERTa) | exact GELU (ELECTRA) -> dropout ->
    ``classifier/out_proj`` ``[H, num_labels]``.
  Dropout is ``classifier_dropout``, or ``hidden_dropout_prob`` when < 0. ``logits [B, num_labels]`` (f32).
* ``QuestionAnswerer`` = ``BertForQuestionAnswering``: ``qa_outputs`` Dense ``[H, 2]`` on the last
  hidden state. ``start_logits, end_logits [B, L]`` (f32).

Parameter tree: ``{'bert': BertModel's params (with the pooler for BERT's classifier), 'classifier' |
'qa_outputs': {kernel [H, n] (logical axes ('embed', None)), bias [n]}}``; RoBERTa's and ELECTRA's
``'classifier'`` is ``{'dense': {kernel [H, H] ('embed', 'embed_out'), bias}, 'out_proj': {kernel
[H, n], bias}}``, as transformers names them. The losses are
``transformers``' (``classification_loss``, ``regression_loss``, ``span_loss``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tacl_jax.models import BertConfig, BertModel, to_dtype
from tacl_jax.models.dropout import Dropout
from tacl_jax.models.layers import Dense, gelu


def uses_pooler(cfg: BertConfig) -> bool:
    """Whether the family's sequence classifier reads the pooler (BERT's only)."""
    return cfg.model_type == "bert"


def _head(cfg: BertConfig, n: int | None, name: str) -> Dense:
    # f32 compute: the head is tiny and its logits feed the loss (as the NSP head).
    # n None: the H -> H dense of RoBERTa's/ELECTRA's classification head.
    out, axes = ((cfg.hidden_size,), ("embed", "embed_out")) if n is None else ((n,), ("embed", None))
    return Dense((cfg.hidden_size,), out, axes, dtype=jnp.float32,
                 param_dtype=to_dtype(cfg.param_dtype), kernel_init=nn.initializers.normal(cfg.initializer_range),
                 kernels=cfg.kernels, name=name)


class SequenceClassifier(nn.Module):
    """``(input_ids, attention_mask, token_type_ids [B, L]) -> logits [B, num_labels]``."""

    config: BertConfig            # with_pooler = uses_pooler(config)
    num_labels: int
    classifier_dropout: float = -1.0

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic: bool = True):
        cfg = self.config
        out = BertModel(cfg, name="bert")(input_ids, attention_mask, token_type_ids, deterministic=deterministic)
        rate = cfg.hidden_dropout_prob if self.classifier_dropout < 0 else self.classifier_dropout
        if uses_pooler(cfg):
            pooled = Dropout(rate, cfg.dropout_bits, cfg.kernels)(out.pooled, deterministic=deterministic)
            return _head(cfg, self.num_labels, "classifier")(pooled)
        return FirstTokenHead(cfg, self.num_labels, rate, name="classifier")(
            out.last_hidden_state[:, 0], deterministic=deterministic)


class FirstTokenHead(nn.Module):
    """RoBERTa's / ELECTRA's classification head: ``x [B, H] -> logits [B, num_labels]`` =
    out_proj(dropout(act(dense(dropout(x))))), act tanh (RoBERTa) or exact GELU (ELECTRA: its
    authors' choice, kept by transformers' ElectraClassificationHead)."""

    config: BertConfig
    num_labels: int
    dropout_rate: float

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        cfg = self.config
        act = gelu if cfg.model_type == "electra" else jnp.tanh
        x = Dropout(self.dropout_rate, cfg.dropout_bits, cfg.kernels)(x, deterministic=deterministic)
        h = act(_head(cfg, None, "dense")(x))
        h = Dropout(self.dropout_rate, cfg.dropout_bits, cfg.kernels)(h, deterministic=deterministic)
        return _head(cfg, self.num_labels, "out_proj")(h)


class QuestionAnswerer(nn.Module):
    """``(input_ids, attention_mask, token_type_ids [B, L]) -> (start_logits, end_logits) [B, L]``."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic: bool = True):
        cfg = self.config
        out = BertModel(cfg, name="bert")(input_ids, attention_mask, token_type_ids, deterministic=deterministic)
        logits = _head(cfg, 2, "qa_outputs")(out.last_hidden_state)
        return logits[..., 0], logits[..., 1]


def classification_loss(logits, labels, weights):
    """Mean cross-entropy over the rows with ``weights`` 1 (padding rows 0). ``logits [B, C]``."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def regression_loss(logits, labels, weights):
    """Mean squared error (``transformers``' ``MSELoss`` on ``logits.squeeze()``). ``logits [B, 1]``."""
    se = jnp.square(logits[:, 0] - labels)
    return jnp.sum(se * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def span_loss(start_logits, end_logits, start_positions, end_positions, weights):
    """(CE(start) + CE(end)) / 2, as ``BertForQuestionAnswering`` (positions outside the sequence
    are clamped to L and ignored there; here they never occur: no-answer windows point at [CLS])."""
    return 0.5 * (classification_loss(start_logits, start_positions, weights)
                  + classification_loss(end_logits, end_positions, weights))


def build_model(cfg: BertConfig, kind: str, num_labels: int, classifier_dropout: float = -1.0) -> nn.Module:
    """The head module of a task kind ('classification' | 'regression' | 'qa')."""
    if kind == "qa":
        return QuestionAnswerer(cfg.replace(with_pooler=False, with_mlm_head=False, with_nsp_head=False))
    return SequenceClassifier(cfg.replace(with_pooler=uses_pooler(cfg), with_mlm_head=False, with_nsp_head=False),
                              num_labels, classifier_dropout)


def loss_and_outputs(model: nn.Module, kind: str, params, batch: dict, *, deterministic: bool = True,
                     rng: jax.Array | None = None):
    """``(mean loss, outputs)`` of one batch: ``batch`` has ``input_ids, attention_mask,
    token_type_ids [B, L]``, ``weights [B]`` (0 = padding row) and ``labels [B]`` or
    ``start_positions, end_positions [B]`` (without them a QA loss of 0); outputs are the logits
    (a pair for QA)."""
    rngs = {"dropout": rng} if rng is not None else {}
    out = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                      deterministic=deterministic, rngs=rngs)
    w = batch["weights"]
    if kind == "qa" and "start_positions" not in batch:   # validation windows carry no labels
        return jnp.zeros((), jnp.float32), out
    if kind == "qa":
        return span_loss(out[0], out[1], batch["start_positions"], batch["end_positions"], w), out
    if kind == "regression":
        return regression_loss(out, batch["labels"], w), out
    return classification_loss(out, batch["labels"], w), out
