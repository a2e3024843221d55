"""The objective interface and its registry: what the setup and the loop need of a pre-training objective.

``tacl_jax.train.setup.build_program`` builds every run's program through ``get(config.objective)``
and the loop never asks which objective it runs. Adding one (e.g. ELECTRA's replaced-token
detection) is a module implementing :class:`Objective` and an entry in ``REGISTRY`` (and its name in
``tacl_jax.config.OBJECTIVES``, which a test keeps equal to the registry).

The train step every objective returns has one signature, ``train_step(state, teacher_params,
batch, rng) -> (state, metrics)`` (``teacher_params`` is None without a teacher), and its eval
step ``eval_step(params, teacher_params, batch, rng) -> sums`` is built from the same loss
function with dropout off; ``ratios`` turns (summed) sums into metrics.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

from tacl_jax.models import BertConfig

# name -> "module:attribute" of its Objective, imported on first use (no import cycles, and a
# run imports only its own objective's code).
REGISTRY: dict[str, str] = {
    "tacl": "tacl_jax.train.step:TACL",
    "mlm": "tacl_jax.train.step:MLM",
    "coco_lm": "tacl_jax.train.coco_step:COCO_LM",
}


class Objective(Protocol):
    """A pre-training objective, as ``build_program`` assembles it."""

    name: str
    # Where the BERT that is loaded from ``init.hf_path`` and exported to a Hugging Face folder
    # sits in the student's module and parameter tree: None = the student is that BERT; a name =
    # that attribute of the module and key of the params (COCO-LM's ``main``). The rest of the
    # tree starts from the seed. A student module may declare its own ``bert_at`` (TaCL's
    # ``TaclStudent``, with a teacher of another size): see :func:`bert_at`.
    bert_at: str | None
    console_keys: tuple[str, ...]          # the metrics the console line shows, in order, when present

    def build_model(self, config, bert: BertConfig) -> Any:
        """The student module around ``bert`` (the run's BERT with its numerics resolved)."""

    def step_config(self, config, special_ids: dict[str, int]) -> Any:
        """The static step configuration (a frozen dataclass; ``whole_word``/``nsp`` attributes,
        when present, add ``word_starts``/``next_sentence_label`` to the batch). Raises
        ``ConfigError`` naming the fix for settings the objective cannot run."""

    def teacher_model(self, model, step_cfg) -> Any | None:
        """The frozen teacher's module, or None without a teacher."""

    def has_own_teacher(self, config) -> bool:
        """Whether the teacher is a model of its own (TaCL's ``tacl.teacher_hf_path``) rather than
        the initial student's ``embeddings`` and ``encoder``."""

    def teacher_params(self, config, teacher_model) -> dict:
        """The teacher's own params (host numpy), asked only when ``has_own_teacher``."""

    def train_step(self, model, step_cfg, tx, schedule: Callable, teacher_model) -> Callable:
        """The un-jitted train step (``tacl_jax.train.update.train_step_from``)."""

    def eval_step(self, model, step_cfg, teacher_model) -> Callable:
        """The un-jitted eval step, the train step's loss function with dropout off."""

    def ratios(self, sums: dict) -> dict:
        """Loss sums (summed over batches) -> mean losses and accuracies."""

    def flops(self, model, step_cfg, *, batch: int, length: int) -> float:
        """Model FLOPs of one optimizer step (``tacl_jax.flops`` conventions)."""


class UnknownObjectiveError(ValueError):
    pass


def get(name: str) -> Objective:
    """The registered objective ``name``."""
    if name not in REGISTRY:
        raise UnknownObjectiveError(f"objective {name!r} is not registered; known: {sorted(REGISTRY)}")
    module, attr = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attr)


def bert_at(objective: Objective, model) -> str | None:
    """Where the Hugging Face BERT sits in the student ``model``: the module's own ``bert_at`` when
    it declares one, else the objective's."""
    return getattr(model, "bert_at", objective.bert_at)


def bert_of(objective: Objective, model):
    """The BERT module inside ``model`` that is loaded from and exported to Hugging Face."""
    at = bert_at(objective, model)
    return model if at is None else getattr(model, at)


def bert_params_of(objective: Objective, model, params):
    """That BERT's params inside the student's ``params`` (of the student ``model``)."""
    at = bert_at(objective, model)
    return params if at is None else params[at]


__all__ = ["REGISTRY", "Objective", "UnknownObjectiveError", "get", "bert_at", "bert_of", "bert_params_of"]
