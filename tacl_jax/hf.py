"""Hugging Face BERT, RoBERTa and ELECTRA checkpoints in and out, as parameter trees.

``model, params = hf.load(path)`` reads a Hugging Face BERT folder (``config.json`` plus
``model.safetensors`` (possibly sharded) or ``pytorch_model.bin``, loaded with
``torch.load(weights_only=True)``) into our ``BertModel`` and its parameter tree. Both layouts are
understood: full ``BertForPreTraining``/``BertForMaskedLM`` checkpoints (``bert.`` prefix,
``cls.*`` heads) and encoder-only ones (no prefix, no ``cls.*``, e.g. sentence encoders). Heads
absent from the checkpoint are initialised, and a log line says which. ``path`` may also be a Hub
id (``bert-base-uncased``, ``org/name@revision``), read through the Hugging Face cache (``resolve``;
every reader here, and the tokenizer's, accepts one). The compute dtype defaults to training's
rule (``model.dtype='auto'``: bf16 on TPUs, GPUs and CPUs with bf16 units, else f32).

``hf.save(model, params, out_dir, head="mlm" | "none", overwrite=False | True | "ours")`` writes a
folder that ``transformers`` loads as ``BertForMaskedLM`` (``head="mlm"``) or ``BertModel``
(``head="none"``, TaCL's release format) with no missing or unexpected keys. It writes safetensors
with numpy: no torch needed. The folder is written whole beside ``out_dir`` and then renamed into
place, so ``out_dir`` is never a half-written folder nor a mix of two models; an existing non-empty
``out_dir`` is refused, replaced whole (``overwrite=True``), or replaced only when an earlier
``save`` wrote it (``overwrite="ours"``: its marker file ``tacl_jax_export.json`` lists every file).

Name mapping (HF, without the ``bert.`` prefix -> ours); a torch Linear weight ``[out, in]`` is the
transpose of our kernel ``[in, out]``, reshaped for the attention heads::

    embeddings.{word,position,token_type}_embeddings.weight -> embeddings/<same>/embedding
    embeddings.LayerNorm.{weight,bias}                      -> embeddings/LayerNorm/{scale,bias}
    encoder.layer.N.attention.self.{query,key,value}.*      -> encoder/layer_N/attention/<q|k|v>
    encoder.layer.N.attention.output.dense.*                -> encoder/layer_N/attention/output
    encoder.layer.N.attention.output.LayerNorm.*            -> encoder/layer_N/attention_norm
    encoder.layer.N.intermediate.dense.*                    -> encoder/layer_N/intermediate
    encoder.layer.N.output.dense.* / output.LayerNorm.*     -> encoder/layer_N/output / output_norm
    pooler.dense.*                                          -> pooler
    cls.predictions.transform.dense.* / transform.LayerNorm.* -> mlm_transform / mlm_norm
    cls.predictions.bias                                    -> mlm_bias (padded)
    cls.seq_relationship.*                                  -> nsp

RoBERTa and ELECTRA (``config.json``'s ``model_type``; ``BertConfig.model_type``, ``FAMILIES``) are
the same encoder under their own prefix, with these differences (read and written alike)::

    RoBERTa (RobertaForMaskedLM / RobertaModel; prefix ``roberta.``):
      encoder tensors as BERT's; position ids pad_token_id + 1 + cumsum(ids != pad), pads at
      pad_token_id (``models.bert.position_ids``); type_vocab_size 1; layer_norm_eps 1e-5
    lm_head.dense.* / lm_head.layer_norm.*                  -> mlm_transform / mlm_norm
    lm_head.bias                                            -> mlm_bias (padded)
    lm_head.decoder.{weight,bias}                           -> tied (word embeddings, lm_head.bias)

    ELECTRA (ElectraForPreTraining / ElectraModel / ElectraForMaskedLM; prefix ``electra.``):
      embedding tables and embeddings.LayerNorm of width embedding_size E; no pooler
    embeddings_project.*  (only when E != hidden_size)      -> embeddings/embeddings_project [E, H]
    generator_predictions.dense.* / .LayerNorm.*            -> mlm_transform [H, E] / mlm_norm [E]
    generator_lm_head.bias                                  -> mlm_bias (padded)
    generator_lm_head.weight                                -> tied (word embeddings)
    discriminator_predictions.*                             -> ignored (a log line says so)

A discriminator has no MLM head: ``load`` initialises one (generator-shaped, H -> E -> tied
decoder) and its log line says that this is an ELECTRA discriminator. ``save`` writes
``RobertaForMaskedLM``/``RobertaModel`` or ``ElectraForMaskedLM``/``ElectraModel`` folders (an
ElectraModel has no pooler, so ours, which ``load`` initialised, is not written).

A model with ``scan_layers=True`` keeps its layers stacked in ``encoder/layers`` (leading axis =
layer N): ``load`` stacks the per-layer tensors into that layout (``bert.stack_layers``) and
``save`` unstacks them (``bert.unstack_layers``), so either layout reads and writes the same files.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import shutil
import socket
import time
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tacl_jax import __version__, precision
from tacl_jax.errors import UserError
from tacl_jax.models import BertConfig, BertModel
from tacl_jax.models.bert import SCAN_NAME, stack_layers, unstack_layers

log = logging.getLogger(__name__)

_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
                "pad_token_id")
# vocab.json + merges.txt: RoBERTa's byte-level BPE for readers without tokenizer.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                   "vocab.json", "merges.txt")
# Written last into every export: it tells ``overwrite="ours"`` that tacl_jax wrote the folder
# (and which files). transformers reads only the files it knows, so an extra JSON is harmless.
EXPORT_MARKER = "tacl_jax_export.json"
# Architecture fields of config.json and the types they must have (a hand-edited or damaged
# config.json fails here with the key named, not later inside the model with a shape error).
_INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "max_position_embeddings", "type_vocab_size")
_FLOAT_KEYS = ("layer_norm_eps", "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range")
# Buffers and tied copies that carry no information of their own.
_IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids", "cls.predictions.decoder.weight",
            "cls.predictions.decoder.bias")
# The checkpoint families: the prefix of the encoder in the task models, the names of their MLM
# head's tensors (HF name -> BERT's ``cls.predictions.*`` name, which the reader and writer below
# speak), the head tensors that are tied copies, transformers' classes, and the config.json
# defaults of the family's config class. RoBERTa and ELECTRA encoders use BERT's tensor names
# under their prefix (ELECTRA adds ``embeddings_project``).
FAMILIES: dict[str, dict[str, Any]] = {
    "bert": dict(prefix="bert.", head={}, tied=(), mlm="BertForMaskedLM", base="BertModel",
                 defaults={}),
    "roberta": dict(prefix="roberta.",
                    head={"lm_head.dense": "cls.predictions.transform.dense",
                          "lm_head.layer_norm": "cls.predictions.transform.LayerNorm",
                          "lm_head.bias": "cls.predictions.bias"},
                    tied=("lm_head.decoder.weight", "lm_head.decoder.bias"),
                    mlm="RobertaForMaskedLM", base="RobertaModel",
                    defaults=dict(pad_token_id=1, vocab_size=50265)),
    "electra": dict(prefix="electra.",
                    head={"generator_predictions.dense": "cls.predictions.transform.dense",
                          "generator_predictions.LayerNorm": "cls.predictions.transform.LayerNorm",
                          "generator_lm_head.bias": "cls.predictions.bias"},
                    tied=("generator_lm_head.weight",),
                    mlm="ElectraForMaskedLM", base="ElectraModel",
                    defaults=dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4)),
}


def architecture_name(cfg: BertConfig, head: str) -> str:
    """transformers' class an export of ``cfg`` with ``head`` ('mlm' | 'none') loads as."""
    fam = FAMILIES[cfg.model_type]
    return fam["mlm"] if head == "mlm" else fam["base"]


def _rename_head(name: str, table: Mapping[str, str]) -> str:
    """``name`` with its leading module path replaced by ``table``'s entry (whole path parts only:
    ``lm_head.bias`` is not a prefix of ``lm_head.bias_x``)."""
    for src, dst in table.items():
        if name == src or name.startswith(src + "."):
            return dst + name[len(src):]
    return name


# ----------------------------------------------------------------------------- reading

class FolderError(UserError, ValueError):
    """A Hugging Face folder that cannot be used as it is: damaged (truncated or garbage
    config.json / weights), inconsistent (vocab_size vs. the embedding rows) or not a BERT. The
    message names the file and what to do."""


class FolderMissingError(UserError, FileNotFoundError):
    """A Hugging Face folder, or a file it needs, that is not there; or a Hub id that is neither
    reachable nor in the Hugging Face cache."""


# ----------------------------------------------------------------------------- folder or Hub id

# What a Hub snapshot fetches: config and tokenizer, then the weights (safetensors, one file or
# shards with their index; pytorch_model.bin only when the repo has no safetensors).
_HUB_META = ("config.json",) + TOKENIZER_FILES
_HUB_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors")
_HUB_TORCH = ("pytorch_model.bin",)
# ``name`` or ``org/name``, optionally ``@revision`` (branch, tag or commit): the Hub's id syntax.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?)"
                     r"(?:@(?P<rev>[^\s@]+))?")


def hub_cache_dir() -> str:
    """The Hugging Face Hub cache folder, read from the environment at each call (HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub); huggingface_hub itself reads it once, at import."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    path = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(path))


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now or when huggingface_hub was imported."""
    on = {"1", "ON", "YES", "TRUE"}
    if any(os.environ.get(k, "").upper() in on for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _hub_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``text`` has a Hub id's form, else None (a local-looking path:
    ``/x``, ``./x``, ``~/x``, ``a/b/c``, ``gs://...``)."""
    m = _HUB_ID.fullmatch(text)
    if m is None or "--" in m["repo"] or ".." in m["repo"] or len(m["repo"]) > 96:
        return None
    return m["repo"], m["rev"]


def resolve(path_or_id: str, *, weights: bool = True) -> str:
    """A Hugging Face checkpoint named by a local folder or a Hub id -> a local folder.

    An existing folder is returned as it is (``~`` expanded). A Hub id (``bert-base-uncased``,
    ``org/name``, ``org/name@revision``) is fetched through huggingface_hub's cache (HF_HUB_CACHE /
    HF_HOME honoured; with HF_HUB_OFFLINE=1 or no connection, the cache alone): config.json, the
    tokenizer files and, with ``weights``, the weights; the snapshot folder is returned. Resolved
    once per process per id (``_hub_snapshot`` is cached). A path that is not a folder and not an
    id, or an id neither reachable nor cached, raises ``FolderMissingError`` with the fix."""
    local = os.path.expanduser(path_or_id)
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        raise FolderMissingError(f"{path_or_id!r} is a file, not a Hugging Face checkpoint folder; give the "
                                 "folder that holds config.json and the weights, or a Hub id")
    hub = _hub_id(path_or_id)
    if hub is None:
        raise FolderMissingError(f"Hugging Face checkpoint folder {path_or_id!r} does not exist; give a local "
                                 "folder (config.json, model.safetensors, tokenizer files) or a Hub id such "
                                 "as bert-base-uncased, read through the Hugging Face cache")
    return _hub_snapshot(hub[0], hub[1], weights, hub_cache_dir(), _hub_offline())


def local_folder(path_or_id: str) -> str | None:
    """The folder of ``path_or_id`` when it is on this machine without any download (a folder, or a
    Hub id whose config.json and tokenizer files are in the cache), else None. For tools that must
    not reach the network (``tacl_jax.aot`` reading a preset's architecture)."""
    local = os.path.expanduser(path_or_id)
    if os.path.isdir(local):
        return local
    hub = _hub_id(path_or_id)
    if hub is None:
        return None
    try:
        return _hub_snapshot(hub[0], hub[1], False, hub_cache_dir(), True)
    except FolderMissingError:
        return None


@functools.cache
def _hub_snapshot(repo_id: str, revision: str | None, weights: bool, cache_dir: str, offline: bool) -> str:
    """The cache's snapshot folder of ``repo_id`` at ``revision``, downloaded first when online."""
    shown = repo_id + (f"@{revision}" if revision else "")
    get = f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}`"
    try:
        import huggingface_hub
        from huggingface_hub.utils import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise FolderMissingError(f"{shown!r} is not a local folder, and reading it from the Hugging Face Hub "
                                 "needs huggingface_hub (pip install huggingface_hub); or pass a local "
                                 "folder") from None
    try:  # a cached snapshot that lacks requested files (newer huggingface_hub versions check it offline)
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:
        IncompleteSnapshotError = ()

    def fetch(patterns) -> str:
        return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                                 local_files_only=offline, allow_patterns=list(patterns))

    try:
        try:
            folder = fetch(_HUB_META + (_HUB_SAFETENSORS if weights else ()))
        except IncompleteSnapshotError:
            if not weights:
                raise
            folder = ""  # offline, a cache with pytorch_model.bin but not the repo's safetensors
        if weights and not any(os.path.isfile(os.path.join(folder, n)) for n in _HUB_SAFETENSORS[:2]):
            folder = fetch(_HUB_META + _HUB_TORCH)
    except LocalEntryNotFoundError as e:  # offline or unreachable, and not (all) in the cache
        cause = e.__cause__ or e
        first = (str(cause).strip().splitlines() or [""])[0]
        why = ("HF_HUB_OFFLINE is set" if offline
               else f"the Hub could not be reached: {type(cause).__name__}: {first}")
        where = ("is not a local folder and only partly in" if isinstance(e, IncompleteSnapshotError)
                 else "is neither a local folder nor in")
        raise FolderMissingError(
            f"{shown!r} {where} the Hugging Face cache at {cache_dir} ({why}): run {get} on a machine with "
            "internet and copy its cache here, set HF_HUB_CACHE to a cache that has it, or pass a local "
            "folder") from None
    except GatedRepoError:
        raise FolderMissingError(f"{shown!r} is a gated repo on the Hugging Face Hub: accept its terms at "
                                 f"https://huggingface.co/{repo_id} and log in (`hf auth login`), or pass a "
                                 "local folder") from None
    except RepositoryNotFoundError:
        raise FolderMissingError(f"{shown!r} is neither a local folder nor a model on the Hugging Face Hub (a "
                                 "private one needs `hf auth login`); check the spelling or pass a local "
                                 "folder") from None
    except RevisionNotFoundError:
        raise FolderMissingError(f"the Hugging Face repo {repo_id!r} has no revision {revision!r}; give a "
                                 "branch, tag or commit it has, or pass a local folder") from None
    except HfHubHTTPError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise FolderMissingError(f"{shown!r} could not be fetched from the Hugging Face Hub ({first}); "
                                 f"retry, run {get} elsewhere and set HF_HUB_CACHE to that cache, or pass "
                                 "a local folder") from None
    log.info("%s: Hugging Face cache snapshot %s", shown, folder)
    return folder


def _damaged(fn: str, what: str) -> str:
    return (f"{fn} is damaged ({what}): re-download the folder, or re-export it if tacl_jax wrote it "
            "(python -m tacl_jax.convert to_hf)")


def _read_json(fn: str) -> Any:
    """``fn`` parsed as JSON; a damaged file (truncated, garbage bytes) raises one line naming it."""
    with open(fn, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for binary garbage
        raise FolderError(_damaged(fn, f"not valid JSON: {e}")) from None


def read_config(path: str) -> BertConfig:
    """``path/config.json`` -> ``BertConfig`` (architecture fields only; numerics keep defaults).
    ``path``: a folder or a Hub id (``resolve``). ``model_type`` 'bert', 'roberta' or 'electra'
    (``FAMILIES``); another raises ``FolderError`` naming the supported ones."""
    path = resolve(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FolderMissingError(f"{cfg_file} not found: a Hugging Face BERT folder needs config.json "
                                "(save one with transformers' save_pretrained)")
    raw = _read_json(cfg_file)
    if not isinstance(raw, dict):
        raise FolderError(_damaged(cfg_file, f"a JSON {type(raw).__name__}, not an object of settings"))
    model_type = raw.get("model_type", "bert")
    if model_type not in FAMILIES:
        raise FolderError(f"{cfg_file}: model_type {model_type!r} is not supported; tacl_jax reads "
                          f"{', '.join(repr(f) for f in FAMILIES)} checkpoints (BERT-architecture encoders): "
                          "give one of those, or convert the checkpoint with transformers first")
    if raw.get("hidden_act", "gelu") != "gelu":
        raise FolderError(f"{cfg_file}: hidden_act {raw['hidden_act']!r} is not supported; "
                         "tacl_jax's BERT uses the exact erf GELU ('gelu')")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise FolderError(f"{cfg_file}: only absolute position embeddings are supported")
    for k in _INT_KEYS + ("embedding_size",):  # bool is an int in Python but never a size
        if k in raw and (isinstance(raw[k], bool) or not isinstance(raw[k], int) or raw[k] < 1):
            raise FolderError(f"{cfg_file}: {k} is {raw[k]!r}, expected a positive integer")
    for k in _FLOAT_KEYS:
        if k in raw and (isinstance(raw[k], bool) or not isinstance(raw[k], (int, float))):
            raise FolderError(f"{cfg_file}: {k} is {raw[k]!r}, expected a number")
    fields = {k: raw[k] for k in _CONFIG_KEYS if k in raw}
    # A key the config.json omits takes the default of the family's transformers config class,
    # as transformers would load the folder (where it differs from BERT's: RoBERTa's pad 1 and
    # vocabulary; ELECTRA's small sizes and embedding_size 128). roberta-base's eps 1e-5, one token
    # type and 514 positions are written in its config.json.
    fields = {**FAMILIES[model_type]["defaults"], **fields}
    if model_type == "electra":
        e = raw.get("embedding_size", 128)
        # ElectraModel has embeddings_project only when the widths differ; equal widths = no projection.
        fields["embedding_size"] = None if e == fields.get("hidden_size", BertConfig.hidden_size) else e
    try:
        return BertConfig(model_type=model_type, **fields)
    except ValueError as e:
        raise FolderError(f"{cfg_file}: {e}") from None


def _load_safetensors(fn: str) -> dict[str, np.ndarray]:
    """One safetensors file -> its tensors; a damaged file raises one line naming it."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not os.path.isfile(fn):
        raise FolderMissingError(f"{fn} is missing: model.safetensors.index.json lists it; re-download "
                                "the folder")
    try:
        return load_file(fn)
    except SafetensorError as e:
        # The header is validated against the file's length on load, so a truncated download or
        # an overwritten file shows up here (e.g. "incomplete metadata, file not fully covered").
        raise FolderError(_damaged(fn, f"not a readable safetensors file: {e}")) from None


def read_state_dict(path: str) -> dict[str, np.ndarray]:
    """All tensors of a HF folder (or Hub id, ``resolve``) as float32 numpy arrays, keyed by their
    HF names.

    A damaged weights file or index (truncated, garbage) raises ``ValueError`` naming it; no
    weights at all raise ``FileNotFoundError``."""
    path = resolve(path)
    st, st_index, pt = (os.path.join(path, n) for n in
                        ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if os.path.isfile(st) or os.path.isfile(st_index):
        if os.path.isfile(st):
            files = [st]
        else:
            index = _read_json(st_index)
            if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
                raise FolderError(_damaged(st_index, "no weight_map object"))
            files = sorted({os.path.join(path, v) for v in index["weight_map"].values()})
        tensors = {}
        for fn in files:
            tensors.update(_load_safetensors(fn))
    elif os.path.isfile(pt):
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"{pt} is a PyTorch pickle and reading it needs torch; install torch or "
                              "convert the folder to model.safetensors") from e
        try:
            # weights_only=True: a checkpoint can never execute code while being read.
            sd = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises RuntimeError (bad zip), UnpicklingError, EOFError, ...
            first = (str(e).strip().splitlines() or [""])[0]  # torch's messages run to many lines
            raise FolderError(f"{pt} cannot be read ({type(e).__name__}: {first}): it is damaged "
                             "(re-download it) or holds more than tensors, which weights_only loading "
                             "refuses so that a checkpoint never runs code") from None
        tensors = {k: v.float().numpy() for k, v in sd.items()}
    else:
        raise FolderMissingError(f"no weights in {path}: expected model.safetensors, "
                                "model.safetensors.index.json or pytorch_model.bin")
    out = {}
    for k, v in tensors.items():
        # Old TF-converted checkpoints name LayerNorm params gamma/beta.
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[k] = np.asarray(v, dtype=np.float32)
    return out


def _linear(sd, name, in_shape=None, out_shape=None):
    w, b = sd.pop(name + ".weight"), sd.pop(name + ".bias")
    k = w.T
    if in_shape is not None:
        k = k.reshape(tuple(in_shape) + k.shape[1:])
    if out_shape is not None:
        k = k.reshape(k.shape[:k.ndim - 1] + tuple(out_shape))
        b = b.reshape(out_shape)
    return {"kernel": k, "bias": b}


def _norm(sd, name):
    return {"scale": sd.pop(name + ".weight"), "bias": sd.pop(name + ".bias")}


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """``x [V, ...]`` -> ``[rows, ...]`` with zero rows appended: the vocabulary padding to
    ``padded_vocab_size`` (a multiple of ``vocab_multiple`` for the MXU/tensor cores). The padded
    rows are masked out of the logits and stripped again by ``save``, so their zeros never matter."""
    return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)]) if rows > x.shape[0] else x


def _check_vocab_rows(x: np.ndarray, name: str, cfg: BertConfig, source: str) -> None:
    """Refuse a checkpoint whose vocabulary tensor ``x [V_ckpt, ...]`` does not have exactly
    ``cfg.vocab_size`` rows. Padding it with zeros would give every added token a zero embedding
    (and, in TaCL, a frozen teacher that keeps it zero), silently; transformers refuses such a
    folder too (size mismatch). Fewer config rows would drop trained rows, also silently."""
    if x.shape[0] != cfg.vocab_size:
        raise FolderError(
            f"{source}: {name} has {x.shape[0]} rows but the config's vocab_size is {cfg.vocab_size}; "
            "the checkpoint and config.json disagree. To add tokens, resize in transformers "
            "(model.resize_token_embeddings(N), which initialises the new rows) and save_pretrained; "
            "otherwise correct vocab_size in config.json")


def state_dict_to_params(sd: Mapping[str, np.ndarray], cfg: BertConfig,
                         source: str = "the checkpoint") -> tuple[dict, list[str]]:
    """HF tensors -> our (numpy) parameter tree, in the scanned layout when ``cfg.scan_layers``.
    Returns ``(params, missing_parts)`` where ``missing_parts`` names the heads the checkpoint does
    not have (``pooler``, ``mlm``, ``nsp``). The tensors are named as ``cfg.model_type``'s family
    names them (``FAMILIES``). The vocabulary tensors (word embeddings ``[V, E]``,
    MLM bias ``[V]``) must have ``V = cfg.vocab_size`` rows; they are zero-padded to
    ``[cfg.padded_vocab_size, ...]``. ``source`` names the checkpoint in error messages."""
    fam = FAMILIES[cfg.model_type]
    sd = dict(sd)
    prefix = fam["prefix"] if any(k.startswith(fam["prefix"]) for k in sd) else ""
    if prefix + "embeddings.word_embeddings.weight" not in sd:
        others = [f for f, v in FAMILIES.items()
                  if f != cfg.model_type and any(k.startswith(v["prefix"]) for k in sd)]
        hint = (f"; its tensors are named like a {others[0]!r} checkpoint: fix config.json's model_type"
                if others else "")
        raise FolderError(f"{source} is not a {cfg.model_type} checkpoint: no "
                          f"{prefix}embeddings.word_embeddings.weight (found e.g. {sorted(sd)[:5]}){hint}")
    for k in list(sd):  # strip the prefix from the encoder tensors; heads get BERT's names
        if k.startswith(tuple(prefix + m for m in ("embeddings.", "embeddings_project.", "encoder.", "pooler."))):
            sd[k[len(prefix):]] = sd.pop(k)
        elif fam["head"]:
            sd[_rename_head(k, fam["head"])] = sd.pop(k)
    for k in fam["tied"]:  # the decoder is tied to the word embeddings (and its bias to the head's)
        sd.pop(k, None)
    _check_vocab_rows(sd["embeddings.word_embeddings.weight"], "embeddings.word_embeddings.weight", cfg, source)
    if "cls.predictions.bias" in sd:
        _check_vocab_rows(sd["cls.predictions.bias"], "cls.predictions.bias", cfg, source)
    nh, hd, h, e = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.embed_size
    emb = {
        "word_embeddings": {"embedding": _pad_rows(sd.pop("embeddings.word_embeddings.weight"),
                                                   cfg.padded_vocab_size)},
        "position_embeddings": {"embedding": sd.pop("embeddings.position_embeddings.weight")},
        "token_type_embeddings": {"embedding": sd.pop("embeddings.token_type_embeddings.weight")},
        "LayerNorm": _norm(sd, "embeddings.LayerNorm"),
    }
    if emb["word_embeddings"]["embedding"].shape[1] != e:
        raise FolderError(f"{source}: embeddings.word_embeddings.weight is "
                          f"{emb['word_embeddings']['embedding'].shape[1]} wide but config.json says "
                          f"{'embedding_size' if e != h else 'hidden_size'} {e}")
    if e != h:  # ELECTRA's factorised embeddings: E -> H after the embeddings' LayerNorm
        if "embeddings_project.weight" not in sd:
            raise FolderError(f"{source} has no embeddings_project although config.json says embedding_size "
                              f"{e} != hidden_size {h}; correct config.json or re-export the checkpoint")
        emb["embeddings_project"] = _linear(sd, "embeddings_project")
    enc = {}
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}."
        try:
            enc[f"layer_{i}"] = {
                "attention": {
                    "query": _linear(sd, p + "attention.self.query", out_shape=(nh, hd)),
                    "key": _linear(sd, p + "attention.self.key", out_shape=(nh, hd)),
                    "value": _linear(sd, p + "attention.self.value", out_shape=(nh, hd)),
                    "output": _linear(sd, p + "attention.output.dense", in_shape=(nh, hd)),
                },
                "attention_norm": _norm(sd, p + "attention.output.LayerNorm"),
                "intermediate": _linear(sd, p + "intermediate.dense"),
                "output": _linear(sd, p + "output.dense"),
                "output_norm": _norm(sd, p + "output.LayerNorm"),
            }
        except KeyError as e:
            raise FolderError(f"{source} is missing {e.args[0]} although config.json says "
                             f"{cfg.num_hidden_layers} layers") from None
    params: dict[str, Any] = {"embeddings": emb, "encoder": enc}
    if cfg.scan_layers:
        params = stack_layers(params, cfg.num_hidden_layers)
    missing = []
    if "pooler.dense.weight" in sd:
        params["pooler"] = _linear(sd, "pooler.dense")
    else:
        missing.append("pooler")
    if "cls.predictions.bias" in sd:
        params["mlm_transform"] = _linear(sd, "cls.predictions.transform.dense")
        params["mlm_norm"] = _norm(sd, "cls.predictions.transform.LayerNorm")
        params["mlm_bias"] = _pad_rows(sd.pop("cls.predictions.bias"), cfg.padded_vocab_size)
    else:
        missing.append("mlm")
    if "cls.seq_relationship.weight" in sd:
        params["nsp"] = _linear(sd, "cls.seq_relationship")
    else:
        missing.append("nsp")
    leftover = [k for k in sd if k not in _IGNORED and not k.endswith("position_ids")]
    if leftover:
        # e.g. ElectraForPreTraining's discriminator_predictions (replaced-token detection head)
        log.warning("ignored %d tensors of the checkpoint that tacl_jax's %s does not use: %s",
                    len(leftover), cfg.model_type, ", ".join(sorted(leftover)[:8]))
    return params, missing


def load(path: str, *, seed: int = 0, **overrides) -> tuple[BertModel, dict]:
    """A Hugging Face BERT, RoBERTa or ELECTRA folder, or Hub id (``bert-base-uncased``,
    ``org/name@revision``, read through the Hugging Face cache; ``resolve``) -> ``(BertModel, params)``.

    ``overrides`` replace ``BertConfig`` fields (e.g. ``dtype="float32"``, ``with_nsp_head=True``,
    ``hidden_dropout_prob=0.0``). ``dtype`` defaults to ``"auto"``, training's rule for the
    platform of ``jax.devices()`` (``precision.resolve_compute_dtype``: bfloat16 on TPUs, GPUs and
    CPUs with bf16 matmul units, float32 on other CPUs). Heads requested but absent from the
    checkpoint are initialised from ``seed`` (BERT's N(0, 0.02) init), with a log line. Params are
    numpy float32 (host memory); ``tacl_jax.parallel`` places them on the mesh.

    ``vocab_size`` is the checkpoint's: an override that differs from config.json, or a
    config.json that disagrees with the embedding rows, raises ``ValueError`` (zero rows for new
    tokens would train silently). A damaged config.json or weights file raises ``ValueError``
    naming the file.
    """
    given, path = path, resolve(path)
    base = read_config(path)
    if overrides.get("vocab_size", base.vocab_size) != base.vocab_size:
        # Another vocabulary size would zero-pad (or cut) the checkpoint's embedding rows; say so
        # here, where the caller's own argument is the cause.
        raise FolderError(f"hf.load({given!r}, vocab_size={overrides['vocab_size']}): its config.json "
                         f"says vocab_size {base.vocab_size}, and a vocabulary cannot be resized on load; to add "
                         "tokens, resize in transformers (model.resize_token_embeddings(N), which "
                         "initialises the new rows) and save_pretrained")
    dtype = overrides.get("dtype", "auto")
    if isinstance(dtype, str) and dtype == "auto":  # training's rule (bert_config), for this process's devices
        overrides["dtype"] = precision.resolve_compute_dtype("auto", precision.platform_of(jax.devices()))
    cfg = base.replace(**overrides)
    params, missing = state_dict_to_params(read_state_dict(path), cfg, source=path)
    wanted = {"pooler": cfg.with_pooler or cfg.with_nsp_head, "mlm": cfg.with_mlm_head, "nsp": cfg.with_nsp_head}
    to_init = [m for m in missing if wanted[m]]
    if to_init:
        model = BertModel(cfg)
        fresh = nn.meta.unbox(jax.jit(lambda r: model.init(r, jnp.zeros((1, 2), jnp.int32))["params"])(
            jax.random.key(seed)))
        names = {"pooler": ["pooler"], "mlm": ["mlm_transform", "mlm_norm", "mlm_bias"], "nsp": ["nsp"]}
        for part in to_init:
            for n in names[part]:
                params[n] = jax.tree.map(np.asarray, fresh[n])
        why = ""
        if cfg.model_type == "electra" and "mlm" in to_init:
            # The usual ELECTRA init: a discriminator (ElectraModel/ElectraForPreTraining) was
            # trained by replaced-token detection and never had a masked-LM head.
            why = (" (an ELECTRA discriminator has no MLM head: the generator-style head H -> "
                   f"{cfg.embed_size} -> tied decoder starts from the seed)")
        log.info("%s has no %s head%s: initialised from seed %d%s", given, ", ".join(to_init),
                 "s" if len(to_init) > 1 else "", seed, why)
    for part, name in (("pooler", "pooler"), ("nsp", "nsp")):
        if not wanted[part]:
            params.pop(name, None)
    if not cfg.with_mlm_head:
        for n in ("mlm_transform", "mlm_norm", "mlm_bias"):
            params.pop(n, None)
    return BertModel(cfg), params


# ----------------------------------------------------------------------------- writing

def host_array(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-host) array -> float32 numpy on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x), dtype=np.float32)


def params_to_state_dict(params: Mapping, cfg: BertConfig, head: str = "mlm") -> dict[str, np.ndarray]:
    """Our parameter tree (unrolled, or scanned when ``cfg.scan_layers``) -> HF tensors for
    ``BertForMaskedLM`` (``head="mlm"``) or ``BertModel`` (``head="none"``), or the RoBERTa/ELECTRA
    classes of ``cfg.model_type`` (``architecture_name``; names in the module docstring).
    Vocabulary padding is stripped."""
    if head not in ("mlm", "none"):
        raise ValueError(f"head={head!r}: use 'mlm' ({architecture_name(cfg, 'mlm')}) or 'none' "
                         f"({architecture_name(cfg, 'none')})")
    fam = FAMILIES[cfg.model_type]
    p = host_tree(params, cfg)
    pre = fam["prefix"] if head == "mlm" else ""
    sd = encoder_state_dict(p, cfg, pre)
    v = cfg.vocab_size
    if head == "none":
        if cfg.model_type != "electra":  # ElectraModel has no pooler: ours (if any) is not written
            if "pooler" not in p:
                raise ValueError(f"this model has no pooler; {fam['base']} needs one (build with "
                                 "with_pooler=True)")
            linear_to_torch(sd, "pooler.dense", p["pooler"])
    else:
        if "mlm_bias" not in p:
            raise ValueError("this model has no MLM head; export with head='none'")
        # Written under BERT's names, then renamed to the family's (RoBERTa's lm_head.*, ELECTRA's
        # generator_predictions.* / generator_lm_head.bias).
        head_sd: dict[str, np.ndarray] = {}
        k = p["mlm_transform"]["kernel"]
        head_sd["cls.predictions.transform.dense.weight"] = np.ascontiguousarray(k.T)
        head_sd["cls.predictions.transform.dense.bias"] = p["mlm_transform"]["bias"]
        head_sd["cls.predictions.transform.LayerNorm.weight"] = p["mlm_norm"]["scale"]
        head_sd["cls.predictions.transform.LayerNorm.bias"] = p["mlm_norm"]["bias"]
        head_sd["cls.predictions.bias"] = p["mlm_bias"][:v]
        back = {dst: src for src, dst in fam["head"].items()}
        sd.update({_rename_head(n, back): a for n, a in head_sd.items()})
    return {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in sd.items()}


def host_tree(params: Mapping, cfg: BertConfig) -> dict:
    """A model's params on the host, unboxed, with the layers unrolled (``encoder/layer_N``)."""
    p = jax.tree.map(host_array, nn.meta.unbox(dict(params)))
    scanned = SCAN_NAME in p["encoder"]
    if scanned != cfg.scan_layers:
        raise ValueError(f"the parameter tree's encoder is {'scanned' if scanned else 'unrolled'} "
                         f"(encoder/{SCAN_NAME if scanned else 'layer_N'}) but the model has "
                         f"scan_layers={cfg.scan_layers}; pass the model these params belong to")
    return unstack_layers(p) if scanned else p


def linear_to_torch(sd: dict, name: str, tree: Mapping) -> None:
    """``sd[name.weight]`` ``[out, in]`` and ``sd[name.bias]`` from our Dense ``{kernel [in..., out...], bias}``."""
    k = tree["kernel"]
    n_out = int(np.prod(tree["bias"].shape))
    sd[name + ".weight"] = np.ascontiguousarray(k.reshape(-1, n_out).T)
    sd[name + ".bias"] = tree["bias"].reshape(n_out)


def encoder_state_dict(p: Mapping, cfg: BertConfig, pre: str) -> dict[str, np.ndarray]:
    """The embeddings' and layers' HF tensors (names prefixed by ``pre``) of an unrolled host tree
    (``host_tree``); vocabulary padding stripped."""
    v = cfg.vocab_size
    sd: dict[str, np.ndarray] = {}

    def lin(name, tree):
        linear_to_torch(sd, name, tree)

    def norm(name, tree):
        sd[name + ".weight"], sd[name + ".bias"] = tree["scale"], tree["bias"]

    e = p["embeddings"]
    sd[pre + "embeddings.word_embeddings.weight"] = e["word_embeddings"]["embedding"][:v]
    sd[pre + "embeddings.position_embeddings.weight"] = e["position_embeddings"]["embedding"]
    sd[pre + "embeddings.token_type_embeddings.weight"] = e["token_type_embeddings"]["embedding"]
    norm(pre + "embeddings.LayerNorm", e["LayerNorm"])
    if "embeddings_project" in e:
        lin(pre + "embeddings_project", e["embeddings_project"])
    for i in range(cfg.num_hidden_layers):
        layer, q = p["encoder"][f"layer_{i}"], f"{pre}encoder.layer.{i}."
        for n in ("query", "key", "value"):
            lin(q + "attention.self." + n, layer["attention"][n])
        lin(q + "attention.output.dense", layer["attention"]["output"])
        norm(q + "attention.output.LayerNorm", layer["attention_norm"])
        lin(q + "intermediate.dense", layer["intermediate"])
        lin(q + "output.dense", layer["output"])
        norm(q + "output.LayerNorm", layer["output_norm"])
    return sd


def hf_config_dict(cfg: BertConfig, head: str) -> dict:
    """The config.json of an export: transformers' config of ``cfg.model_type``."""
    out = {k: getattr(cfg, k) for k in _CONFIG_KEYS}
    out.update(model_type=cfg.model_type, architectures=[architecture_name(cfg, head)],
               hidden_act="gelu", position_embedding_type="absolute", torch_dtype="float32",
               tie_word_embeddings=True)
    if cfg.model_type == "roberta":
        # fairseq's <s> 0 and </s> 2 (RobertaConfig's defaults); pad is the model's own.
        out.update(bos_token_id=0, eos_token_id=2)
    if cfg.model_type == "electra":
        out.update(embedding_size=cfg.embed_size)
    return out


class ExportDirError(UserError, OSError):
    """An export's ``out_dir`` that ``save`` may not (re)place: a file, a path under a file, a
    remote path, or a non-empty folder that ``overwrite`` does not allow replacing. The message is
    one line naming the path and the fix."""


def _check_overwrite(overwrite: bool | str) -> None:
    # `1 == True`: compare by type, so that only the three documented values pass.
    if not (isinstance(overwrite, bool) or overwrite == "ours"):
        raise ValueError(f"overwrite={overwrite!r}: use False (refuse a non-empty folder), True (replace "
                         "it whole) or 'ours' (replace it only if tacl_jax wrote it)")


def _not_ours(out_dir: str, entries: list[str]) -> str | None:
    """Why the folder ``out_dir`` (holding ``entries``) is not an export ``save`` wrote, or None
    when it is: its marker lists every other file in it, so nothing a user added is lost."""
    if EXPORT_MARKER not in entries:
        return f"no {EXPORT_MARKER}"
    try:
        with open(os.path.join(out_dir, EXPORT_MARKER), "rb") as f:
            written = set(json.loads(f.read())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {EXPORT_MARKER} is unreadable"
    extra = sorted(set(entries) - written - {EXPORT_MARKER})
    if extra:
        return f"it holds files tacl_jax did not write: {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}"
    return None


def check_out_dir(out_dir: str, overwrite: bool | str = False) -> None:
    """Raise ``ExportDirError`` unless ``save(..., out_dir, overwrite=overwrite)`` may write there.

    Allowed: ``out_dir`` absent (its parents are created) or an empty folder; any folder with
    ``overwrite=True``; with ``overwrite="ours"``, a folder an earlier ``save`` wrote (its
    ``tacl_jax_export.json`` lists every file in it). Never allowed: a file, or a path under a file.
    Writes nothing, so a command can call it before hours of work (``save`` checks again)."""
    _check_overwrite(overwrite)
    if "://" in out_dir:
        # os.makedirs would create a local folder named "gs:": write locally, then copy (the
        # training loop stages its exports that way).
        raise ExportDirError(f"{out_dir}: hf.save writes local folders only; export to a local folder "
                             "and copy it (e.g. gcloud storage cp -r)")
    target = os.path.realpath(out_dir)  # a symlink to a folder: replace the folder it names
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ExportDirError(f"{out_dir} exists and is a file, not a folder: give an export folder path "
                             "(absent, empty, or an export to replace)")
    up = os.path.dirname(target)
    while not os.path.lexists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise ExportDirError(f"cannot create {out_dir}: {up} is a file, not a folder; move it away or "
                             "export elsewhere")
    if not os.path.isdir(target):
        return
    entries = sorted(os.listdir(target))
    if not entries or overwrite is True:
        return
    if overwrite == "ours":
        why = _not_ours(target, entries)
        if why is None:
            return
        raise ExportDirError(f"{out_dir} is not a tacl_jax export ({why}) and is left as it is: move it "
                             "away, or export elsewhere")
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    raise ExportDirError(f"{out_dir} already exists and is not empty ({shown}): refusing to write a model "
                         "into it; pass --overwrite (overwrite=True) to replace the folder whole, or "
                         "choose another --out")


def _umask() -> int:
    """This process's umask. Linux reports it in /proc; elsewhere it can only be read by setting
    it (briefly, which another thread creating a file at that instant would see)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: str) -> None:
    """Flush a file's data, or a folder's entries (renames), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some network and FUSE filesystems cannot sync a folder (EINVAL): nothing more to do there.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale_tmp(parent: str, name: str) -> None:
    """Delete the temporary folders of earlier saves to ``parent/name`` from this host whose
    process is gone (killed while writing): each holds up to a whole model. A save still running
    (its pid alive) or from another host sharing the filesystem is left alone."""
    prefix = f".{name}.tmp-{socket.gethostname()}-"
    for entry in os.listdir(parent):
        pid = entry[len(prefix):]
        if entry.startswith(prefix) and pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            log.info("removing %s, left by an export that did not finish", os.path.join(parent, entry))
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def save(model: BertModel, params: Mapping, out_dir: str, head: str = "mlm",
         tokenizer_from: str | None = None, overwrite: bool | str = False) -> str:
    """Write ``params`` as a Hugging Face folder: config.json, model.safetensors, the tokenizer
    files of ``tokenizer_from`` (if given: a folder or a Hub id) and ``tacl_jax_export.json`` (version, time, head and
    the list of files; transformers ignores it).

    The folder is written whole as a hidden sibling ``.{name}.tmp-{host}-{pid}`` and renamed into
    place, so ``out_dir`` never holds a half-written export or a mix of two models (such a sibling
    left by a killed save on this host is deleted by the next save). An existing
    non-empty ``out_dir`` is handled by ``overwrite``: ``False`` refuses it, ``True`` replaces it
    whole, ``"ours"`` replaces it only if ``save`` wrote it (its marker lists every file in it; the
    training loop's exports) and refuses any other folder. Refusals raise ``ExportDirError`` (see
    ``check_out_dir``) before anything is written; a replaced folder is deleted only after the new
    one is in place. Files get the modes of normal files (0666 less the umask). Local paths only.

    Safe to call from every process of a multi-host run: all take part in gathering sharded
    params, only process 0 checks and writes. Returns ``out_dir``.
    """
    _check_overwrite(overwrite)  # before the gather: the same on every process, so none waits alone
    cfg = model.config
    sd = params_to_state_dict(params, cfg, head)
    return write_folder(sd, hf_config_dict(cfg, head), out_dir, head=head, tokenizer_from=tokenizer_from,
                        overwrite=overwrite)


def write_folder(sd: Mapping[str, np.ndarray], config: dict, out_dir: str, *, head: str,
                 tokenizer_from: str | None = None, overwrite: bool | str = False) -> str:
    """``save``'s writer: ``sd`` (HF tensor names -> host arrays) as model.safetensors, ``config``
    as config.json (its ``architectures[0]`` is recorded in the marker with ``head``), the tokenizer
    files and the marker, written whole beside ``out_dir`` and renamed into place (``save``'s
    rules for ``overwrite``). Process 0 writes; the others return at once. Returns ``out_dir``."""
    from safetensors.numpy import save_file

    _check_overwrite(overwrite)
    if jax.process_index() != 0:
        return out_dir
    check_out_dir(out_dir, overwrite)
    tok_files = []
    if tokenizer_from:
        tokenizer_from = resolve(tokenizer_from, weights=False)  # a folder or a Hub id
        tok_files = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_from, n))]
        if not tok_files:
            raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tokenizer_from}")
    target = os.path.realpath(out_dir)
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_tmp(parent, name)
    # A sibling, not a system temp folder: the final rename must stay on one filesystem. The host
    # in the name tells whose process it is when several hosts share the filesystem.
    tmp = os.path.join(parent, f".{name}.tmp-{socket.gethostname()}-{os.getpid()}")
    old = os.path.join(parent, f".{name}.old-{socket.gethostname()}-{os.getpid()}")
    os.mkdir(tmp)  # not tempfile.mkdtemp: that folder would be 0700, and it becomes the export
    try:
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        for n in tok_files:
            shutil.copyfile(os.path.join(tokenizer_from, n), os.path.join(tmp, n))
        files = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
            json.dump({"written_by": "tacl_jax.hf.save", "tacl_jax": __version__,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "head": head,
                       "architecture": config["architectures"][0],
                       "files": files,
                       "note": "a later tacl_jax export with overwrite='ours' may replace this folder "
                               "while it holds only these files"}, f, indent=2)
        # safetensors creates its file 0600 (unlike open()); exports are meant to be shared.
        mode = 0o666 & ~_umask()
        for n in files + [EXPORT_MARKER]:
            os.chmod(os.path.join(tmp, n), mode)
            _fsync(os.path.join(tmp, n))  # complete on disk before the rename makes it visible
        check_out_dir(out_dir, overwrite)  # again: the folder may have appeared while we wrote
        if os.path.isdir(target):
            # rename() cannot replace a non-empty folder: move the old one aside first. Between
            # the two renames out_dir is briefly absent, never partial.
            if os.path.lexists(old):
                shutil.rmtree(old)
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(parent)  # the renames themselves survive a crash
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


# ----------------------------------------------------------------------------- checking

def fill_mask(export_dir: str, text: str, top_k: int = 5) -> list[tuple[str, float]]:
    """Run ``text`` (with one [MASK]) through an export with ``transformers`` (needs torch):
    the top-k tokens and their probabilities."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(export_dir)
    model = transformers.AutoModelForMaskedLM.from_pretrained(export_dir).eval()
    enc = tok(text, return_tensors="pt")
    where = (enc["input_ids"][0] == tok.mask_token_id).nonzero()
    if len(where) != 1:
        raise ValueError(f"the fill-mask text needs exactly one {tok.mask_token}: {text!r}")
    with torch.no_grad():
        probs = model(**enc).logits[0, where[0, 0]].softmax(-1)
    top = probs.topk(top_k)
    return [(tok.convert_ids_to_tokens(int(i)), float(p)) for p, i in zip(top.values, top.indices)]
