"""The TaCL and MLM objectives: masking, the frozen teacher, the student, MLM + TaCL (+ NSP) losses.

``train_step(state, teacher_params, batch, rng) -> (state, metrics)`` (``TACL.train_step``):

* ``batch``: global arrays ``input_ids``, ``attention_mask``, ``token_type_ids`` (``[B, L]``
  int32), optionally ``word_starts`` ``[B, L]`` and ``next_sentence_label`` ``[B]``;
* ``rng``: the run's base key; the step folds in ``state.step`` (``update.train_step_from``);
* ``teacher_params``: frozen, a separate argument, never donated; its forward is deterministic
  (unless ``teacher_dropout``, the original's bug kept as an option) on the *original* ids and
  sits under ``stop_gradient``, so XLA keeps none of its activations. None for ``mlm``.
  By default the teacher is the student's initial encoder; with ``tacl.teacher_hf_path`` another
  checkpoint (``tacl_jax.train.teacher``), and the student a ``TaclStudent`` whose learned
  projection maps its anchors into the teacher's hidden size before the contrastive loss.

Evaluation (``make_eval_step``) is the same loss function with dropout off and a fixed mask key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from tacl_jax.flops import step_flops
from tacl_jax.models import BertConfig, BertModel
from tacl_jax.models.tacl_student import TaclStudent
from tacl_jax.objectives import Masked, mask_tokens, objective_sums, ratios, total_loss
from tacl_jax.train import teacher as teacher_lib
from tacl_jax.train.update import accumulate, train_step_from


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything the step needs besides arrays; built once from the run's config."""

    objective: str                      # 'tacl' | 'mlm'
    max_predictions: int
    mask_id: int
    special_ids: tuple[int, ...]
    mask_prob: float = 0.15
    replace_prob: float = 0.8
    random_prob: float = 0.1
    whole_word: bool = False
    budget: str = "bert"                # how many positions a row selects (config masking.budget)
    temperature: float = 0.01
    mask_pad_keys: bool = True
    teacher_dropout: bool = False
    anchors: str = "selected"           # 'selected' | 'all' (every non-pad position; config tacl.anchors)
    nsp: bool = False
    # The student's last layer only at the predicted positions (BertModel's last_layer_positions):
    # with NSP off, MLM and TaCL read nothing else of it.
    gather_last_layer: bool = True
    weights: tuple[tuple[str, float], ...] = (("mlm", 1.0), ("tacl", 1.0), ("nsp", 1.0))
    grad_accum_steps: int = 1

    @property
    def uses_teacher(self) -> bool:
        return self.objective == "tacl" and dict(self.weights).get("tacl", 0.0) != 0.0


def step_config_from(config, special: dict[str, int]) -> StepConfig:
    """``StepConfig`` from the run's ``ml_collections`` config and the tokenizer's special ids."""
    from tacl_jax.objectives import num_predictions

    m = config.masking
    budget = m.get("budget", "bert")
    max_pred = m.max_predictions if m.max_predictions > 0 else num_predictions(
        config.max_len, m.mask_prob, budget=budget, whole_word=m.whole_word)
    return StepConfig(
        objective=config.objective, max_predictions=int(max_pred), mask_id=int(special["mask"]),
        special_ids=tuple(int(special[k]) for k in ("pad", "cls", "sep", "mask", "unk")),
        mask_prob=m.mask_prob, replace_prob=m.replace_prob, random_prob=m.random_prob, budget=budget,
        whole_word=m.whole_word, temperature=config.tacl.temperature, mask_pad_keys=config.tacl.mask_pad_keys,
        teacher_dropout=config.tacl.teacher_dropout, nsp=config.nsp, anchors=config.tacl.get("anchors", "selected"),
        # With every position an anchor the whole last layer is needed.
        gather_last_layer=bool(config.model.get("gather_last_layer", True))
        and config.tacl.get("anchors", "selected") == "selected",
        weights=tuple(sorted(dict(config.loss_weights).items())), grad_accum_steps=config.grad_accum_steps)


def teacher_of(model: BertModel | TaclStudent) -> BertModel:
    """The teacher's module, without heads (TaCL only reads its last hidden state): the student's
    architecture, or a ``TaclStudent``'s separate teacher."""
    cfg = model.teacher if isinstance(model, TaclStudent) else model.config
    return BertModel(cfg.replace(with_mlm_head=False, with_pooler=False, with_nsp_head=False))


def student_forward(model: BertModel, step_cfg: StepConfig, params, masked_ids: jax.Array,
                    attention_mask: jax.Array, token_type_ids: jax.Array, positions: jax.Array, *,
                    deterministic: bool, padded_vocab: bool = False, rngs: dict | None = None):
    """The student's forward for the objective: ``mlm_logits [B, P, V]`` at ``positions [B, P]``
    and ``last_hidden_state`` ``[B, P, H]`` there when ``step_cfg.gather_last_layer`` (the last
    layer computed only at the predicted positions), else ``[B, L, H]``. ``objective_sums``
    takes the latter form with ``student_at_slots=step_cfg.gather_last_layer``."""
    where = (dict(last_layer_positions=positions) if step_cfg.gather_last_layer
             else dict(mlm_positions=positions))
    return model.apply({"params": params}, masked_ids, attention_mask, token_type_ids, deterministic=deterministic,
                       padded_vocab=padded_vocab, rngs=rngs, **where)


def prepare_batch(model: BertModel, sc: StepConfig, batch: dict, mask_rng: jax.Array) -> tuple[dict, dict]:
    """``(mb, counts)``: the global batch's rows with the mask drawn from ``mask_rng`` (``masked_ids``,
    ``selected`` ``[B, L]``; ``positions``, ``targets``, ``weights`` ``[B, P]``) and the
    denominators of the whole batch (``n_pred``, ``n_anchor``, ``n_seq``): each micro-batch's
    loss is its sum divided by these, so accumulated gradients are weighted by token count exactly."""
    masked = mask_tokens(mask_rng, batch["input_ids"], batch["attention_mask"],
                         max_predictions=sc.max_predictions, mask_id=sc.mask_id, vocab_size=model.config.vocab_size,
                         special_ids=sc.special_ids, mask_prob=sc.mask_prob, replace_prob=sc.replace_prob,
                         random_prob=sc.random_prob,
                         word_starts=batch.get("word_starts") if sc.whole_word else None, budget=sc.budget)
    mb = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              token_type_ids=batch["token_type_ids"], masked_ids=masked.input_ids, selected=masked.selected,
              positions=masked.positions, targets=masked.targets, weights=masked.weights)
    if sc.nsp:
        mb["next_sentence_label"] = batch["next_sentence_label"]
    anchors = batch["attention_mask"] if sc.anchors == "all" else masked.selected
    counts = dict(n_pred=masked.weights.sum(), n_anchor=anchors.sum().astype(jnp.float32),
                  n_seq=jnp.asarray(batch["input_ids"].shape[0], jnp.float32))
    return mb, counts


def make_loss_fn(model: BertModel, sc: StepConfig, teacher_model: BertModel | None = None,
                 deterministic: bool = False) -> Callable:
    """``loss_fn(params, teacher_params, mb, counts, dropout_rng) -> (loss, sums)`` of one
    (micro-)batch ``mb`` from ``prepare_batch``: the teacher on the original ids, the student on
    the masked ones, ``objective_sums`` (see ``objectives.combined``). ``deterministic``: dropout
    off in both forwards (evaluation). ``teacher_model`` defaults to ``model``; pass the same
    architecture without heads (``teacher_of``: its params then need only the encoder)."""
    teacher_model = teacher_model or model
    weights = dict(sc.weights)

    def loss_fn(params, teacher_params, mb, counts, dropout_rng):
        d_student, d_teacher = jax.random.split(dropout_rng)
        teacher_hidden = None
        if sc.uses_teacher:
            t = teacher_model.apply({"params": teacher_params}, mb["input_ids"], mb["attention_mask"],
                                    mb["token_type_ids"], deterministic=deterministic or not sc.teacher_dropout,
                                    heads=False, rngs={"dropout": d_teacher})
            teacher_hidden = jax.lax.stop_gradient(t.last_hidden_state)
        out = student_forward(model, sc, params, mb["masked_ids"], mb["attention_mask"], mb["token_type_ids"],
                              mb["positions"], deterministic=deterministic, padded_vocab=True,
                              rngs={"dropout": d_student})
        student_hidden = out.last_hidden_state
        if teacher_hidden is not None and isinstance(model, TaclStudent):
            # Into the teacher's hidden size (identity when equal); [B, P or L, H_t].
            student_hidden = model.apply({"params": params}, student_hidden, method=TaclStudent.project)
        sums = objective_sums(
            mlm_logits=out.mlm_logits, masked=_masked_from(mb), student_hidden=student_hidden,
            teacher_hidden=teacher_hidden, key_mask=mb["attention_mask"] if sc.mask_pad_keys else None,
            temperature=sc.temperature, nsp_logits=out.nsp_logits if sc.nsp else None,
            nsp_labels=mb.get("next_sentence_label"), student_at_slots=sc.gather_last_layer,
            anchor_mask=mb["attention_mask"] if sc.anchors == "all" else None)
        return total_loss(sums, counts, weights), sums

    return loss_fn


def make_loss_and_grads(model: BertModel, step_cfg: StepConfig,
                        teacher_model: BertModel | None = None) -> Callable:
    """``loss_and_grads(params, teacher_params, batch, step_rng) -> (loss, sums, grads)``: masking,
    both forwards, the objective and its gradient for one global batch, accumulated over
    ``grad_accum_steps`` micro-batches (``update.accumulate``: on a data-parallel mesh the
    gradients are reduced across devices once per step, after the loop). ``sums`` are the loss
    sums and counts (see ``objectives.combined``); ``step_rng`` is the run's key already folded
    with the step."""
    loss_fn = make_loss_fn(model, step_cfg, teacher_model)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, teacher_params, batch: dict, step_rng: jax.Array):
        mask_rng, dropout_rng = jax.random.split(step_rng)
        mb, counts = prepare_batch(model, step_cfg, batch, mask_rng)
        k = step_cfg.grad_accum_steps
        if k == 1:
            (loss, sums), grads = grad_fn(params, teacher_params, mb, counts, dropout_rng)
            return loss, sums, grads
        return accumulate(loss_fn, params, teacher_params, mb, counts, dropout_rng, k)

    return loss_and_grads


def make_train_step(model: BertModel, step_cfg: StepConfig, tx: optax.GradientTransformation,
                    schedule: Callable[[Any], Any], teacher_model: BertModel | None = None) -> Callable:
    """The un-jitted ``train_step`` (``update.train_step_from``); ``setup.build_program`` jits it."""
    return train_step_from(make_loss_and_grads(model, step_cfg, teacher_model), tx, schedule, ratios)


def make_eval_step(model: BertModel, step_cfg: StepConfig, teacher_model: BertModel | None = None) -> Callable:
    """``eval_step(params, teacher_params, batch, rng) -> sums``: the training loss function with
    dropout off and the mask drawn from ``rng`` (a fixed key per held-out batch), so numbers
    compare across runs and steps."""
    loss_fn = make_loss_fn(model, step_cfg, teacher_model, deterministic=True)

    def eval_step(params, teacher_params, batch, rng):
        mb, counts = prepare_batch(model, step_cfg, batch, rng)
        return loss_fn(params, teacher_params, mb, counts, rng)[1]

    return eval_step


def _masked_from(mb: dict) -> Masked:
    return Masked(input_ids=mb["masked_ids"], selected=mb["selected"], positions=mb["positions"],
                  targets=mb["targets"], weights=mb["weights"])


class TaclObjective:
    """``objective='tacl'`` (MLM + token contrastive against the frozen teacher) and ``'mlm'`` (the
    baseline: the same step without the teacher), for ``tacl_jax.train.objective``."""

    bert_at = None     # the student *is* the BERT that is loaded from and exported to Hugging Face
    console_keys = ("loss", "mlm_loss", "mlm_acc", "tacl_loss", "tacl_acc", "nsp_loss", "mlm_perplexity")

    def __init__(self, name: str):
        self.name = name

    def build_model(self, config, bert: BertConfig) -> BertModel | TaclStudent:
        if teacher_lib.teacher_path(config):      # a teacher of its own: the student gets the projection
            return TaclStudent(BertModel(bert), teacher_lib.teacher_config(config, bert))
        return BertModel(bert)

    def step_config(self, config, special_ids: dict[str, int]) -> StepConfig:
        return step_config_from(config, special_ids)

    def teacher_model(self, model: BertModel, step_cfg: StepConfig) -> BertModel | None:
        return teacher_of(model) if step_cfg.uses_teacher else None

    def has_own_teacher(self, config) -> bool:
        return bool(teacher_lib.teacher_path(config))

    def teacher_params(self, config, teacher_model: BertModel) -> dict:
        """The separate teacher's params, from ``tacl.teacher_hf_path``."""
        return teacher_lib.teacher_params(config, teacher_model.config, config.seed)

    def train_step(self, model, step_cfg, tx, schedule, teacher_model) -> Callable:
        return make_train_step(model, step_cfg, tx, schedule, teacher_model)

    def eval_step(self, model, step_cfg, teacher_model) -> Callable:
        return make_eval_step(model, step_cfg, teacher_model)

    def ratios(self, sums: dict) -> dict:
        return ratios(sums)

    def flops(self, model: BertModel, step_cfg: StepConfig, *, batch: int, length: int) -> float:
        return step_flops(model.config, batch=batch, length=length, predictions=step_cfg.max_predictions,
                          teacher=step_cfg.uses_teacher, gathered_last_layer=step_cfg.gather_last_layer,
                          anchors=length if step_cfg.anchors == "all" else None,
                          teacher_cfg=model.teacher if isinstance(model, TaclStudent) else None)


TACL, MLM = TaclObjective("tacl"), TaclObjective("mlm")

__all__ = ["StepConfig", "step_config_from", "teacher_of", "student_forward", "prepare_batch", "make_loss_fn",
           "make_loss_and_grads", "make_train_step", "make_eval_step", "TaclObjective", "TACL", "MLM"]
