"""Hugging Face BERT checkpoints in and out, as parameter trees.

``model, params = hf.load(path)`` reads a Hugging Face BERT folder (``config.json`` plus
``model.safetensors`` (possibly sharded) or ``pytorch_model.bin``, loaded with
``torch.load(weights_only=True)``) into our ``BertModel`` and its parameter tree. Both layouts are
understood: full ``BertForPreTraining``/``BertForMaskedLM`` checkpoints (``bert.`` prefix,
``cls.*`` heads) and encoder-only ones (no prefix, no ``cls.*``, e.g. sentence encoders). Heads
absent from the checkpoint are initialised, and a log line says which.

``hf.save(model, params, out_dir, head="mlm" | "none")`` writes a folder that ``transformers``
loads as ``BertForMaskedLM`` (``head="mlm"``) or ``BertModel`` (``head="none"``, TaCL's release
format) with no missing or unexpected keys. It writes safetensors with numpy: no torch needed.

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

A model with ``scan_layers=True`` keeps its layers stacked in ``encoder/layers`` (leading axis =
layer N): ``load`` stacks the per-layer tensors into that layout (``bert.stack_layers``) and
``save`` unstacks them (``bert.unstack_layers``), so either layout reads and writes the same files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tacl_jax.models import BertConfig, BertModel
from tacl_jax.models.bert import SCAN_NAME, stack_layers, unstack_layers

log = logging.getLogger(__name__)

_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
                "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
# Buffers and tied copies that carry no information of their own.
_IGNORED = ("embeddings.position_ids", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


# ----------------------------------------------------------------------------- reading

def _check_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face checkpoint folder {path!r} does not exist; give a local "
                                "folder with config.json and model.safetensors (download one with "
                                "`huggingface-cli download bert-base-uncased --local-dir DIR`)")


def read_config(path: str) -> BertConfig:
    """``path/config.json`` -> ``BertConfig`` (architecture fields only; numerics keep defaults)."""
    _check_folder(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face BERT folder needs config.json "
                                "(save one with transformers' save_pretrained)")
    with open(cfg_file) as f:
        raw = json.load(f)
    if raw.get("model_type", "bert") != "bert":
        raise ValueError(f"{cfg_file}: model_type {raw.get('model_type')!r} is not 'bert'; "
                         "tacl_jax implements the BERT architecture only")
    if raw.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{cfg_file}: hidden_act {raw['hidden_act']!r} is not supported; "
                         "tacl_jax's BERT uses the exact erf GELU ('gelu')")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{cfg_file}: only absolute position embeddings are supported")
    return BertConfig(**{k: raw[k] for k in _CONFIG_KEYS if k in raw})


def read_state_dict(path: str) -> dict[str, np.ndarray]:
    """All tensors of a HF folder as float32 numpy arrays, keyed by their HF names."""
    st, st_index, pt = (os.path.join(path, n) for n in
                        ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if os.path.isfile(st) or os.path.isfile(st_index):
        from safetensors.numpy import load_file
        if os.path.isfile(st):
            files = [st]
        else:
            with open(st_index) as f:
                files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
        tensors = {}
        for fn in files:
            tensors.update(load_file(fn))
    elif os.path.isfile(pt):
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"{pt} is a PyTorch pickle and reading it needs torch; install torch or "
                              "convert the folder to model.safetensors") from e
        # weights_only=True: a checkpoint can never execute code while being read.
        sd = torch.load(pt, map_location="cpu", weights_only=True)
        tensors = {k: v.float().numpy() for k, v in sd.items()}
    else:
        raise FileNotFoundError(f"no weights in {path}: expected model.safetensors, "
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
    return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)]) if rows > x.shape[0] else x


def state_dict_to_params(sd: Mapping[str, np.ndarray], cfg: BertConfig) -> tuple[dict, list[str]]:
    """HF tensors -> our (numpy) parameter tree, in the scanned layout when ``cfg.scan_layers``.
    Returns ``(params, missing_parts)`` where ``missing_parts`` names the heads the checkpoint does
    not have (``pooler``, ``mlm``, ``nsp``)."""
    sd = dict(sd)
    prefix = "bert." if any(k.startswith("bert.") for k in sd) else ""
    if prefix + "embeddings.word_embeddings.weight" not in sd:
        raise ValueError("not a BERT checkpoint: no embeddings.word_embeddings.weight "
                         f"(found e.g. {sorted(sd)[:5]})")
    for k in list(sd):  # strip the prefix from the encoder tensors; heads keep their names
        if k.startswith(prefix + "embeddings.") or k.startswith(prefix + "encoder.") or k.startswith(prefix + "pooler."):
            sd[k[len(prefix):]] = sd.pop(k)
    nh, hd, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    emb = {
        "word_embeddings": {"embedding": _pad_rows(sd.pop("embeddings.word_embeddings.weight"),
                                                   cfg.padded_vocab_size)},
        "position_embeddings": {"embedding": sd.pop("embeddings.position_embeddings.weight")},
        "token_type_embeddings": {"embedding": sd.pop("embeddings.token_type_embeddings.weight")},
        "LayerNorm": _norm(sd, "embeddings.LayerNorm"),
    }
    if emb["word_embeddings"]["embedding"].shape[1] != h:
        raise ValueError("word embedding width does not match config.json hidden_size")
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
            raise ValueError(f"checkpoint is missing {e.args[0]} although config.json says "
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
        log.warning("ignored %d tensors of the checkpoint that BERT does not use: %s",
                    len(leftover), ", ".join(sorted(leftover)[:8]))
    return params, missing


def load(path: str, *, seed: int = 0, **overrides) -> tuple[BertModel, dict]:
    """A Hugging Face BERT folder -> ``(BertModel, params)``.

    ``overrides`` replace ``BertConfig`` fields (e.g. ``dtype="float32"``, ``with_nsp_head=True``,
    ``hidden_dropout_prob=0.0``). Heads requested but absent from the checkpoint are initialised
    from ``seed`` (BERT's N(0, 0.02) init), with a log line. Params are numpy float32 (host memory);
    ``tacl_jax.parallel`` places them on the mesh.
    """
    cfg = read_config(path).replace(**overrides)
    params, missing = state_dict_to_params(read_state_dict(path), cfg)
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
        log.info("%s has no %s head%s: initialised from seed %d", path, ", ".join(to_init),
                 "s" if len(to_init) > 1 else "", seed)
    for part, name in (("pooler", "pooler"), ("nsp", "nsp")):
        if not wanted[part]:
            params.pop(name, None)
    if not cfg.with_mlm_head:
        for n in ("mlm_transform", "mlm_norm", "mlm_bias"):
            params.pop(n, None)
    return BertModel(cfg), params


# ----------------------------------------------------------------------------- writing

def _host(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-host) array -> float32 numpy on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x), dtype=np.float32)


def params_to_state_dict(params: Mapping, cfg: BertConfig, head: str = "mlm") -> dict[str, np.ndarray]:
    """Our parameter tree (unrolled, or scanned when ``cfg.scan_layers``) -> HF tensors for
    ``BertForMaskedLM`` (``head="mlm"``) or ``BertModel`` (``head="none"``). Vocabulary padding is
    stripped."""
    if head not in ("mlm", "none"):
        raise ValueError(f"head={head!r}: use 'mlm' (BertForMaskedLM) or 'none' (BertModel)")
    p = jax.tree.map(_host, nn.meta.unbox(dict(params)))
    scanned = SCAN_NAME in p["encoder"]
    if scanned != cfg.scan_layers:
        raise ValueError(f"the parameter tree's encoder is {'scanned' if scanned else 'unrolled'} "
                         f"(encoder/{SCAN_NAME if scanned else 'layer_N'}) but the model has "
                         f"scan_layers={cfg.scan_layers}; pass the model these params belong to")
    if scanned:
        p = unstack_layers(p)
    v, h = cfg.vocab_size, cfg.hidden_size
    pre = "bert." if head == "mlm" else ""
    sd: dict[str, np.ndarray] = {}

    def lin(name, tree):
        k = tree["kernel"]
        n_out = int(np.prod(tree["bias"].shape))
        sd[name + ".weight"] = np.ascontiguousarray(k.reshape(-1, n_out).T)
        sd[name + ".bias"] = tree["bias"].reshape(n_out)

    def norm(name, tree):
        sd[name + ".weight"], sd[name + ".bias"] = tree["scale"], tree["bias"]

    e = p["embeddings"]
    sd[pre + "embeddings.word_embeddings.weight"] = e["word_embeddings"]["embedding"][:v]
    sd[pre + "embeddings.position_embeddings.weight"] = e["position_embeddings"]["embedding"]
    sd[pre + "embeddings.token_type_embeddings.weight"] = e["token_type_embeddings"]["embedding"]
    norm(pre + "embeddings.LayerNorm", e["LayerNorm"])
    for i in range(cfg.num_hidden_layers):
        layer, q = p["encoder"][f"layer_{i}"], f"{pre}encoder.layer.{i}."
        for n in ("query", "key", "value"):
            lin(q + "attention.self." + n, layer["attention"][n])
        lin(q + "attention.output.dense", layer["attention"]["output"])
        norm(q + "attention.output.LayerNorm", layer["attention_norm"])
        lin(q + "intermediate.dense", layer["intermediate"])
        lin(q + "output.dense", layer["output"])
        norm(q + "output.LayerNorm", layer["output_norm"])
    if head == "none":
        if "pooler" not in p:
            raise ValueError("this model has no pooler; BertModel needs one (build with with_pooler=True)")
        lin("pooler.dense", p["pooler"])
    else:
        if "mlm_bias" not in p:
            raise ValueError("this model has no MLM head; export with head='none'")
        lin("cls.predictions.transform.dense", p["mlm_transform"])
        norm("cls.predictions.transform.LayerNorm", p["mlm_norm"])
        sd["cls.predictions.bias"] = p["mlm_bias"][:v]
    return {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in sd.items()}


def hf_config_dict(cfg: BertConfig, head: str) -> dict:
    out = {k: getattr(cfg, k) for k in _CONFIG_KEYS}
    out.update(model_type="bert", architectures=["BertForMaskedLM" if head == "mlm" else "BertModel"],
               hidden_act="gelu", position_embedding_type="absolute", torch_dtype="float32",
               tie_word_embeddings=True)
    return out


def save(model: BertModel, params: Mapping, out_dir: str, head: str = "mlm",
         tokenizer_from: str | None = None) -> str:
    """Write ``params`` as a Hugging Face folder (config.json + model.safetensors [+ tokenizer]).

    Safe to call from every process of a multi-host run: all take part in gathering sharded
    params, only process 0 writes. Returns ``out_dir``.
    """
    from safetensors.numpy import save_file

    cfg = model.config
    sd = params_to_state_dict(params, cfg, head)
    if jax.process_index() != 0:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    # Write under temporary names, then rename: a reader never sees a half-written file.
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, head), f, indent=2, sort_keys=True)
    if tokenizer_from:
        copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_from, n))]
        if not copied:
            raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tokenizer_from}")
        for n in copied:
            shutil.copyfile(os.path.join(tokenizer_from, n), os.path.join(out_dir, n))
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
