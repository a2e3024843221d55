"""A fine-tuned model as a Hugging Face folder that ``transformers`` loads, with no missing or
unexpected keys, as ``{Bert,Roberta,Electra}ForSequenceClassification`` or
``...ForQuestionAnswering`` (the checkpoint's family).

Tensors: the encoder under the family's prefix (``bert.`` / ``roberta.`` / ``electra.``; names as
``tacl_jax.hf``), then the head (``heads``):

    BERT classification      bert.pooler.dense.*, classifier.*
    RoBERTa/ELECTRA          classifier.dense.*, classifier.out_proj.*   (no pooler)
    QA (every family)        qa_outputs.*                                 (the classes build no pooler)

config.json is the family's (``hf.hf_config_dict``) with the architecture, and for classification
and regression ``id2label``/``label2id`` (the task's label names, so ``num_labels``) and
``problem_type`` ('single_label_classification' | 'regression', which picks transformers' loss).
Written like pre-training's exports (``hf.write_folder``): whole, then renamed into place.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np

from tacl_jax import hf

def architecture(cfg, kind: str) -> str:
    """transformers' class of a fine-tuned ``cfg.model_type`` model of task ``kind`` (the family's
    base class name, ``hf.FAMILIES``, with its task suffix: BertModel -> BertForQuestionAnswering)."""
    family = hf.FAMILIES[cfg.model_type]["base"].removesuffix("Model")
    return family + ("ForQuestionAnswering" if kind == "qa" else "ForSequenceClassification")


def state_dict(params, cfg, kind: str) -> dict[str, np.ndarray]:
    """``{'bert': ..., 'classifier' | 'qa_outputs': ...}`` (``heads``' tree) -> HF tensors (f32)."""
    pre = hf.FAMILIES[cfg.model_type]["prefix"]
    enc = hf.host_tree(params["bert"], cfg)
    sd = hf.encoder_state_dict(enc, cfg, pre)
    head = jax.tree.map(hf.host_array, nn.meta.unbox({k: v for k, v in params.items() if k != "bert"}))
    if kind == "qa":
        hf.linear_to_torch(sd, "qa_outputs", head["qa_outputs"])
    elif "dense" in head["classifier"]:          # RoBERTa's / ELECTRA's two-layer head
        for n in ("dense", "out_proj"):
            hf.linear_to_torch(sd, f"classifier.{n}", head["classifier"][n])
    else:
        if "pooler" not in enc:
            raise ValueError("a BERT sequence classifier without a pooler: build it with heads.build_model")
        hf.linear_to_torch(sd, pre + "pooler.dense", enc["pooler"])
        hf.linear_to_torch(sd, "classifier", head["classifier"])
    return {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in sd.items()}


def config_dict(cfg, task) -> dict:
    """config.json of the export of ``task`` (a ``tasks.Task`` with its labels filled in)."""
    out = hf.hf_config_dict(cfg, "none")
    out["architectures"] = [architecture(cfg, task.kind)]
    if task.kind != "qa":
        names = list(task.labels) if task.kind == "classification" else ["LABEL_0"]
        out["id2label"] = {str(i): n for i, n in enumerate(names)}
        out["label2id"] = {n: i for i, n in enumerate(names)}
        out["problem_type"] = "regression" if task.kind == "regression" else "single_label_classification"
    return out


def save(model, params, out_dir: str, task, *, tokenizer_from: str | None = None,
         overwrite: bool | str = "ours") -> str:
    """Write the fine-tuned ``model`` (``heads.build_model``'s) and ``params`` to ``out_dir``."""
    cfg = model.config
    return hf.write_folder(state_dict(params, cfg, task.kind), config_dict(cfg, task), out_dir,
                           head=task.kind, tokenizer_from=tokenizer_from, overwrite=overwrite)
