"""BERT in Flax Linen, functionally identical to Hugging Face's ``BertForPreTraining``.

One module serves the student and the frozen teacher: they are two parameter trees applied to the
same ``BertModel``. Every parameter carries logical axis names (``vocab``, ``embed``, ``heads``,
``kv``, ``mlp``, ``position``, ``type``) and the main activations carry ``activation_*`` names;
``tacl_jax.parallel`` maps them onto the device mesh. The model knows nothing about meshes.

Parameter tree (names mirror the Hugging Face checkpoint, see ``tacl_jax.hf``)::

    embeddings/{word_embeddings,position_embeddings,token_type_embeddings}/embedding [*, E], LayerNorm [E]
    embeddings/embeddings_project/{kernel [E, H], bias [H]}   (ELECTRA with embedding_size E != H)
    encoder/layer_{i}/attention/{query,key,value}/kernel [H, heads, head_dim], bias [heads, head_dim]
    encoder/layer_{i}/attention/output/kernel [heads, head_dim, H], bias [H]; attention_norm
    encoder/layer_{i}/intermediate/kernel [H, I]; output/kernel [I, H]; output_norm
    pooler/{kernel,bias}                       (when ``with_pooler``)
    mlm_transform/{kernel [H, E], bias [E]}, mlm_norm [E], mlm_bias [V_padded]   (when ``with_mlm_head``)
    nsp/{kernel,bias}                          (when ``with_nsp_head``)

With ``scan_layers=True`` the encoder is one ``nn.scan`` over a single ``Layer`` (one compiled
layer body instead of N copies: shorter compiles on deep models) and the per-layer subtrees
``encoder/layer_{i}/...`` become one subtree ``encoder/layers/...`` whose every leaf has a leading
layer axis of size ``num_hidden_layers`` (logical name ``layers``, never sharded), e.g.
``encoder/layers/attention/query/kernel [N, H, heads, head_dim]``. ``stack_layers`` and
``unstack_layers`` convert between the two layouts (``tacl_jax.hf`` reads and writes either).

Model families (``BertConfig.model_type``; ``tacl_jax.hf`` reads and writes each one's Hugging Face
layout): ``'bert'``; ``'roberta'`` (the same encoder; position ids start past the padding index,
``pad_token_id + 1 + cumsum(non-pad)``, pads at ``pad_token_id``, as fairseq and transformers
compute them); ``'electra'`` (the same encoder; embeddings of width ``embedding_size`` E projected to
H by ``embeddings_project`` when E != H, and the MLM head mapping H back to E before the tied
decoder, as transformers' ``ElectraForMaskedLM`` generator head). E = H when ``embedding_size`` is
None (every BERT and RoBERTa): no projection, and the tree is BERT's.

The MLM decoder is tied to the word embeddings, whose rows are padded to a multiple of
``vocab_multiple`` (128) so the vocabulary dimension shards and tiles evenly; the padded rows are
never returned and never win a softmax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tacl_jax.models.attention import dot_product_attention
from tacl_jax.models.dropout import DROPOUT_BITS, Dropout
from tacl_jax.models.layers import KERNELS, Dense, LayerNorm, gelu, tied_decoder

MODEL_TYPES = ("bert", "roberta", "electra")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "save_dots")
SCAN_NAME = "layers"   # the scanned encoder's subtree and its stacked axis' logical name


def to_dtype(name: str | Any) -> Any:
    if not isinstance(name, str):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture and numerics. Field names follow Hugging Face's ``BertConfig`` (and
    ``ElectraConfig``'s ``embedding_size``)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    # 16: masks from 16-bit uniforms, four per threefry block (tacl_jax.models.dropout); 32: flax's.
    dropout_bits: int = 16
    initializer_range: float = 0.02
    pad_token_id: int = 0
    # The checkpoint family (MODEL_TYPES): decides the position ids (RoBERTa's start past the
    # padding index) and the Hugging Face names tacl_jax.hf reads and writes.
    model_type: str = "bert"
    # ELECTRA's factorised embeddings: width of the embedding tables (None = hidden_size, no
    # projection). Only 'electra' has it: BERT and RoBERTa folders cannot express it.
    embedding_size: int | None = None
    # Heads. The pooler is part of HF's BertModel/BertForPreTraining, so it is kept by default
    # (an export as BertModel then has no missing keys) even when NSP is off.
    with_pooler: bool = True
    with_mlm_head: bool = True
    with_nsp_head: bool = False
    # Numerics: parameters in ``param_dtype``, matmuls and activations in ``dtype``.
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    vocab_multiple: int = 128
    remat_policy: str = "none"
    # One ``nn.scan`` over the layers (params ``encoder/layers/...`` stacked on a leading axis).
    scan_layers: bool = False
    # 'xla' (TPU/GPU: plain dots) | 'cpu' (XLA:CPU-only kernel forms, tacl_jax.models.layers);
    # decided from the platform of the run's devices (tacl_jax.precision.kernels_for), not the host.
    kernels: str = "xla"

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {MODEL_TYPES}")
        if self.embedding_size is not None:
            if isinstance(self.embedding_size, bool) or not isinstance(self.embedding_size, int) \
                    or self.embedding_size < 1:
                raise ValueError(f"embedding_size {self.embedding_size!r}: a positive integer, or None "
                                 "(= hidden_size)")
            if self.model_type != "electra":
                raise ValueError(f"embedding_size {self.embedding_size} needs model_type 'electra' (a "
                                 f"{self.model_type!r} checkpoint has embeddings of width hidden_size); "
                                 "set model_type='electra' or embedding_size=None")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy {self.remat_policy!r} is not one of {REMAT_POLICIES}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels {self.kernels!r} is not one of {KERNELS}")
        if self.dropout_bits not in DROPOUT_BITS:
            raise ValueError(f"dropout_bits {self.dropout_bits!r} is not one of {DROPOUT_BITS}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} {getattr(self, name)} is not in [0, 1]")
        to_dtype(self.dtype), to_dtype(self.param_dtype)

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    @property
    def embed_size(self) -> int:
        """E: the width of the embedding tables and of the MLM head's output (``hidden_size``
        unless ELECTRA's ``embedding_size`` says otherwise)."""
        return self.hidden_size if self.embedding_size is None else self.embedding_size

    @property
    def max_length(self) -> int:
        """The longest input: ``max_position_embeddings``, less RoBERTa's ``pad_token_id + 1``
        position rows that no token uses (its positions start at ``pad_token_id + 1``)."""
        if self.model_type == "roberta":
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def replace(self, **kw) -> "BertConfig":
        return dataclasses.replace(self, **kw)


# The fields a run decides (``tacl_jax.train.setup.bert_config``: dtypes, kernels, dropout, layout)
# rather than a checkpoint's config.json; heads aside, the rest is the architecture. A second model
# of the run (a teacher of another size) takes these from the student.
NUMERIC_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout_bits", "dtype", "param_dtype",
                  "vocab_multiple", "remat_policy", "scan_layers", "kernels")


@flax.struct.dataclass
class BertOutput:
    """``last_hidden_state [B, L, H]``; ``mlm_logits`` ``[B, L, V]`` or ``[B, P, V]`` at gathered
    positions (V = the unpadded vocabulary, ``V_padded`` with ``padded_vocab=True``; f32);
    ``hidden_states``: embeddings output then every layer, each ``[B, L, H]`` (when asked);
    ``pooled [B, H]``; ``nsp_logits [B, 2]``."""

    last_hidden_state: jax.Array
    mlm_logits: jax.Array | None = None
    hidden_states: tuple[jax.Array, ...] | None = None
    pooled: jax.Array | None = None
    nsp_logits: jax.Array | None = None

    def __getitem__(self, key):  # mapping-style access, as the API documents
        return getattr(self, key)


def _embed_param(module: nn.Module, name: str, num: int, features: int, axes, cfg: BertConfig):
    return module.param(name, nn.with_logical_partitioning(
        nn.initializers.normal(cfg.initializer_range), axes), (num, features), to_dtype(cfg.param_dtype))


def position_ids(input_ids: jax.Array, cfg: BertConfig) -> jax.Array:
    """Position ids ``[B, L]`` (int32) or ``[1, L]`` of ``input_ids [B, L]``: ``0..L-1`` for BERT and
    ELECTRA; for RoBERTa transformers' ``create_position_ids_from_input_ids``, ``pad + cumsum(m) · m``
    with ``m = input_ids != pad``, so real tokens count from ``pad + 1`` and pads (wherever they
    are) sit at ``pad``."""
    if cfg.model_type != "roberta":
        return jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None]
    m = (input_ids != cfg.pad_token_id).astype(jnp.int32)
    return jnp.cumsum(m, axis=1, dtype=jnp.int32) * m + cfg.pad_token_id


class Embeddings(nn.Module):
    """``input_ids, token_type_ids [B, L] -> [B, L, H]``: word + position + token type (tables of
    width E), LayerNorm, dropout, then (ELECTRA, E != H) ``embeddings_project`` E -> H. With one
    token type (``type_vocab_size=1``, RoBERTa) the segment ids are ignored."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids, token_type_ids, deterministic: bool):
        cfg = self.config
        dtype = to_dtype(cfg.dtype)
        e = cfg.embed_size
        word = nn.Embed(cfg.padded_vocab_size, e, dtype=jnp.float32,
                        param_dtype=to_dtype(cfg.param_dtype),
                        embedding_init=nn.with_logical_partitioning(
                            nn.initializers.normal(cfg.initializer_range), ("vocab", "embed")),
                        name="word_embeddings")
        pos = nn.Embed(cfg.max_position_embeddings, e, dtype=jnp.float32,
                       param_dtype=to_dtype(cfg.param_dtype),
                       embedding_init=nn.with_logical_partitioning(
                           nn.initializers.normal(cfg.initializer_range), ("position", "embed")),
                       name="position_embeddings")
        typ = nn.Embed(cfg.type_vocab_size, e, dtype=jnp.float32,
                       param_dtype=to_dtype(cfg.param_dtype),
                       embedding_init=nn.with_logical_partitioning(
                           nn.initializers.normal(cfg.initializer_range), ("type", "embed")),
                       name="token_type_embeddings")
        if cfg.type_vocab_size == 1:
            # One token type (RoBERTa): the batch's segment ids (1 after the first [SEP] in the
            # packers' and the synthetic rows) have no row to index; every token is type 0.
            token_type_ids = jnp.zeros_like(token_type_ids)
        # Looked up and summed in f32 (as HF does in fp32), then one rounding to the compute dtype:
        # the tables' gradients are then scatter-added (and all-reduced) in f32, not bf16.
        x = (word(input_ids).astype(jnp.float32) + pos(position_ids(input_ids, cfg)).astype(jnp.float32)
             + typ(token_type_ids).astype(jnp.float32))
        x = LayerNorm(cfg.layer_norm_eps, dtype, to_dtype(cfg.param_dtype), name="LayerNorm")(x)
        x = Dropout(cfg.hidden_dropout_prob, cfg.dropout_bits, cfg.kernels)(x, deterministic=deterministic)
        if e != cfg.hidden_size:
            # ElectraModel.embeddings_project: after the embeddings' dropout, no activation.
            x = Dense((e,), (cfg.hidden_size,), ("embed_out", "embed"), dtype=dtype,
                      param_dtype=to_dtype(cfg.param_dtype),
                      kernel_init=nn.initializers.normal(cfg.initializer_range),
                      name="embeddings_project", kernels=cfg.kernels)(x)
        return nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))

    def attend(self, hidden: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        """Tied decoder: ``hidden [..., H] (+ bias [V_padded]) -> logits [..., V_padded]`` (f32) with
        the word embeddings (``layers.tied_decoder``: no transposed copy of the table)."""
        cfg = self.config
        table = self.variables["params"]["word_embeddings"]["embedding"]
        table = nn.meta.unbox(table) if isinstance(table, nn.meta.AxisMetadata) else table
        if bias is None:
            bias = jnp.zeros((table.shape[0],), jnp.float32)
        h = hidden.reshape(-1, hidden.shape[-1])
        logits = tied_decoder(h, table, bias, to_dtype(cfg.dtype), cfg.kernels)
        return logits.reshape(hidden.shape[:-1] + (table.shape[0],))


class SelfAttention(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, bias, deterministic: bool, queries=None):
        """``x [B, L, H]``, additive ``bias [B, 1, 1, L]`` (0 or very negative) -> ``[B, L, H]``;
        with ``queries [B, P, H]`` (states at P of the L positions), only those attend (keys and
        values still from every position of ``x``) -> ``[B, P, H]``."""
        cfg = self.config
        dtype, pdtype = to_dtype(cfg.dtype), to_dtype(cfg.param_dtype)
        nh, hd, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        init = nn.initializers.normal(cfg.initializer_range)

        def proj(name, inputs):
            return Dense((h,), (nh, hd), ("embed", "heads", "kv"), dtype=dtype, param_dtype=pdtype,
                         kernel_init=init, name=name, kernels=cfg.kernels)(inputs)

        q = proj("query", x if queries is None else queries)
        k, v = proj("key", x), proj("value", x)
        q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
        drop = Dropout(cfg.attention_probs_dropout_prob, cfg.dropout_bits, cfg.kernels)
        ctx = dot_product_attention(q, k, v, bias, dropout=lambda p: drop(p, deterministic=deterministic),
                                    kernels=cfg.kernels)
        out = Dense((nh, hd), (h,), ("heads", "kv", "embed"), dtype=dtype, param_dtype=pdtype,
                    kernel_init=init, name="output", kernels=cfg.kernels)(ctx)
        return out


def attention_bias(attention_mask: jax.Array) -> jax.Array:
    """``attention_mask [B, L]`` (1 = attend) -> the additive key bias ``[B, 1, 1, L]`` (f32: 0, or
    the most negative float for a masked key)."""
    return jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)


def take_positions(x: jax.Array, positions: jax.Array) -> jax.Array:
    """``x [B, L, ...]``, ``positions [B, P]`` (int) -> ``x`` at those positions, ``[B, P, ...]``."""
    idx = positions.astype(jnp.int32).reshape(positions.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


class Layer(nn.Module):
    """A post-LN transformer layer: ``x = LN(x + Attn(x)); x = LN(x + FFN(x))``.

    ``positions [B, P]`` (optional): compute the output only at those positions, ``[B, P, H]``.
    Each position's output depends on the other positions only through the keys and values, so
    they are computed from every position and everything else (queries, the attention output,
    both LayerNorms, the FFN) from the P positions alone: equal to the full layer's output there.
    """

    config: BertConfig

    @nn.compact
    def __call__(self, x, bias, deterministic: bool, positions=None):
        cfg = self.config
        dtype, pdtype = to_dtype(cfg.dtype), to_dtype(cfg.param_dtype)
        init = nn.initializers.normal(cfg.initializer_range)
        xq = None if positions is None else take_positions(x, positions)
        a = SelfAttention(cfg, name="attention")(x, bias, deterministic, queries=xq)
        a = Dropout(cfg.hidden_dropout_prob, cfg.dropout_bits, cfg.kernels)(a, deterministic=deterministic)
        if xq is not None:
            x = xq
        x = LayerNorm(cfg.layer_norm_eps, dtype, pdtype, name="attention_norm")(
            x.astype(jnp.float32) + a.astype(jnp.float32))
        hmid = Dense((cfg.hidden_size,), (cfg.intermediate_size,), ("embed", "mlp"), dtype=dtype,
                     param_dtype=pdtype, kernel_init=init, name="intermediate", kernels=cfg.kernels)(x)
        hmid = nn.with_logical_constraint(gelu(hmid), ("activation_batch", "activation_length", "activation_mlp"))
        o = Dense((cfg.intermediate_size,), (cfg.hidden_size,), ("mlp", "embed"), dtype=dtype,
                  param_dtype=pdtype, kernel_init=init, name="output", kernels=cfg.kernels)(hmid)
        o = Dropout(cfg.hidden_dropout_prob, cfg.dropout_bits, cfg.kernels)(o, deterministic=deterministic)
        x = LayerNorm(cfg.layer_norm_eps, dtype, pdtype, name="output_norm")(
            x.astype(jnp.float32) + o.astype(jnp.float32))
        return nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))


def _layer_class(policy: str):
    if policy == "none":
        return Layer
    if policy == "full":
        return nn.remat(Layer, static_argnums=(3,))
    return nn.remat(Layer, static_argnums=(3,), policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


class Encoder(nn.Module):
    """``num_hidden_layers`` layers, unrolled (``layer_{i}``) or, with ``scan_layers``, one
    ``nn.scan`` over a single ``Layer`` (``layers``, params stacked on axis 0); the remat policy
    wraps the layer body either way."""

    config: BertConfig

    @nn.compact
    def __call__(self, x, bias, deterministic: bool, output_hidden_states: bool, last_positions=None):
        """``last_positions [B, P]``: the last layer only at those positions (``Layer``), so the
        output (and the last entry of the hidden states) is ``[B, P, H]``."""
        cls = _layer_class(self.config.remat_policy)
        n = self.config.num_hidden_layers
        if self.config.scan_layers:
            if last_positions is None or self.is_initializing():
                out, states = self._scanned(cls, x, bias, deterministic, output_hidden_states)
                if last_positions is not None:   # init: the full scan makes the stacked params
                    out = take_positions(out, last_positions)
                    states = None if states is None else states[:-1] + (out,)
                return out, states
            return self._scanned_then_last(cls, x, bias, deterministic, output_hidden_states, last_positions)
        states = [x] if output_hidden_states else None
        for i in range(n):
            x = cls(self.config, name=f"layer_{i}")(x, bias, deterministic,
                                                    last_positions if i == n - 1 else None)
            if output_hidden_states:
                states.append(x)
        return x, (tuple(states) if output_hidden_states else None)

    def _scanned(self, cls, x, bias, deterministic: bool, output_hidden_states: bool):
        n = self.config.num_hidden_layers

        def body(layer, carry, bias_):
            y = layer(carry, bias_, deterministic)
            return y, (y if output_hidden_states else None)

        scan = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                       in_axes=(nn.broadcast,), length=n,
                       metadata_params={nn.PARTITION_NAME: SCAN_NAME})
        out, ys = scan(cls(self.config, name=SCAN_NAME), x, bias)
        if not output_hidden_states:
            return out, None
        # ys [N, B, L, H]: layer i's output is ys[i]; the embeddings output comes first.
        return out, (x,) + tuple(ys[i] for i in range(n))

    def _scanned_then_last(self, cls, x, bias, deterministic: bool, output_hidden_states: bool, positions):
        """The scanned layout with the last layer at ``positions [B, P]`` only: layers 0..N-2 as one
        ``lax.scan`` over the first N-1 slices of the stacked params, then layer N-1 on its own
        (``Layer``'s ``positions``). Written with ``Layer.apply`` on the slices because ``nn.scan``
        runs one body over all N slices. The slices are copies of the stacked weights (and their
        gradients are joined again), one pass over the encoder's parameters, against the ~(1 - P/L)
        of the last layer's non-K/V work saved in the forward and the backward (on the CPU: 1.04-1.13x
        faster steps, XLA's temporary buffer -67 MB at the bench's ``small`` bf16 and +85 MB at
        bert-base fp32). Dropout: one key per layer split from this module's stream, so the draws
        differ from the full scan's (as the gathered unrolled layer's differ from the full one's)."""
        n = self.config.num_hidden_layers
        stacked = nn.meta.unbox(self.variables["params"][SCAN_NAME])
        layer = cls(self.config, parent=None)
        keys = None if deterministic else jax.random.split(self.make_rng("dropout"), n)

        def apply(p, h, key, pos):
            rngs = None if key is None else {"dropout": key}
            return layer.apply({"params": p}, h, bias, deterministic, pos, rngs=rngs)

        def body(h, xs):
            p, key = xs
            y = apply(p, h, key, None)
            return y, (y if output_hidden_states else None)

        first = jax.tree.map(lambda a: a[:n - 1], stacked)
        last = jax.tree.map(lambda a: a[n - 1], stacked)
        h, ys = jax.lax.scan(body, x, (first, None if keys is None else keys[:n - 1]), length=n - 1)
        out = apply(last, h, None if keys is None else keys[n - 1], positions)
        if not output_hidden_states:
            return out, None
        return out, (x,) + tuple(ys[i] for i in range(n - 1)) + (out,)


def stack_layers(params: dict, num_layers: int | None = None) -> dict:
    """An unrolled parameter tree (``encoder/layer_{i}``) -> the scanned layout
    (``encoder/layers``, every leaf stacked on a new leading axis). Pure; takes unboxed params
    (plain arrays, not ``LogicallyPartitioned``); other subtrees are kept as they are; numpy in,
    numpy out (``jnp`` arrays are stacked with ``jnp``). ``num_layers`` (default: as many as the
    tree has) must match the tree. A tree already scanned is returned unchanged."""
    enc = params["encoder"]
    if SCAN_NAME in enc and not any(k.startswith("layer_") for k in enc):
        return params
    found = sorted(int(k[len("layer_"):]) for k in enc if k.startswith("layer_"))
    n = len(found) if num_layers is None else int(num_layers)
    if found != list(range(n)) or len(enc) != n:
        raise ValueError(f"stack_layers: expected encoder/layer_0..layer_{n - 1}, found {sorted(enc)}")
    layers = [enc[f"layer_{i}"] for i in range(n)]

    def stack(*xs):
        if all(isinstance(a, np.ndarray) for a in xs):
            return np.stack(xs)
        return jnp.stack(xs)
    return {**params, "encoder": {SCAN_NAME: jax.tree.map(stack, *layers)}}


def unstack_layers(params: dict) -> dict:
    """The scanned layout (``encoder/layers``) -> the unrolled one (``encoder/layer_{i}``). Pure;
    the inverse of ``stack_layers``."""
    enc = params["encoder"]
    if SCAN_NAME not in enc:
        if any(k.startswith("layer_") for k in enc):
            return params
        raise ValueError(f"unstack_layers: no encoder/{SCAN_NAME} in the tree (found {sorted(enc)})")
    if len(enc) != 1:
        raise ValueError(f"unstack_layers: encoder has {sorted(enc)}; expected only {SCAN_NAME!r}")
    stacked = enc[SCAN_NAME]
    n = {int(x.shape[0]) for x in jax.tree.leaves(stacked)}
    if len(n) != 1:
        raise ValueError(f"unstack_layers: leaves of encoder/{SCAN_NAME} disagree on the layer count {sorted(n)}")
    n = n.pop()
    return {**params, "encoder": {f"layer_{i}": jax.tree.map(lambda a: a[i], stacked) for i in range(n)}}


class BertModel(nn.Module):
    """BERT with optional pooler, MLM and NSP heads (``BertForPreTraining`` when all are on).

    ``__call__(input_ids [B, L], attention_mask [B, L] (1 = attend), token_type_ids [B, L],
    deterministic, output_hidden_states, mlm_positions [B, P] | None, heads)``:
      * ``heads=True``: MLM logits (at every position, or only at ``mlm_positions``, which is
        ~15% of the vocabulary-projection cost) and NSP logits when the model has the heads.
      * ``heads=False``: the encoder only (what the frozen teacher needs).
      * ``padded_vocab=True``: MLM logits over the padded vocabulary (see ``mlm_logits``).
      * ``last_layer_positions [B, P]``: the last encoder layer only at those positions (what
        MLM and TaCL read when only the predicted positions matter: the train step's
        ``gather_last_layer``). ``last_hidden_state`` and the MLM logits are then ``[B, P, ...]``
        at those positions (``mlm_positions`` must be None); the pooler and NSP, which read
        [CLS], are computed only when the model has the NSP head, from an extra slot the model
        adds for position 0 (``pooled`` is None otherwise).
    """

    config: BertConfig

    def setup(self):
        cfg = self.config
        dtype, pdtype = to_dtype(cfg.dtype), to_dtype(cfg.param_dtype)
        init = nn.initializers.normal(cfg.initializer_range)
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        if cfg.with_pooler or cfg.with_nsp_head:
            self.pooler = Dense((cfg.hidden_size,), (cfg.hidden_size,), ("embed", "embed_out"),
                                dtype=dtype, param_dtype=pdtype, kernel_init=init, kernels=cfg.kernels)
        if cfg.with_mlm_head:
            # H -> E: ELECTRA's generator head maps back to the (tied) embeddings' width.
            self.mlm_transform = Dense((cfg.hidden_size,), (cfg.embed_size,), ("embed", "embed_out"),
                                       dtype=dtype, param_dtype=pdtype, kernel_init=init, kernels=cfg.kernels)
            self.mlm_norm = LayerNorm(cfg.layer_norm_eps, dtype, pdtype)
            self.mlm_bias = self.param("mlm_bias", nn.with_logical_partitioning(
                nn.initializers.zeros, ("vocab",)), (cfg.padded_vocab_size,), pdtype)
        if cfg.with_nsp_head:
            self.nsp = Dense((cfg.hidden_size,), (2,), ("embed", None), dtype=jnp.float32,
                             param_dtype=pdtype, kernel_init=init, kernels=cfg.kernels)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic: bool = True,
                 output_hidden_states: bool = False, mlm_positions=None, heads: bool = True,
                 padded_vocab: bool = False, last_layer_positions=None) -> BertOutput:
        cfg = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if input_ids.shape[1] > cfg.max_length:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds the model's {cfg.max_length} "
                             f"positions (max_position_embeddings {cfg.max_position_embeddings}, less "
                             "pad_token_id + 1 for RoBERTa); shorten max_len")
        x = self.embeddings(input_ids, token_type_ids, deterministic)
        bias = attention_bias(attention_mask)
        gathered = last_layer_positions is not None
        cls_slot = gathered and heads and cfg.with_nsp_head
        if gathered:
            if mlm_positions is not None:
                raise ValueError("pass either mlm_positions or last_layer_positions (the MLM head then "
                                 "reads every gathered slot), not both")
            if cls_slot:   # NSP reads [CLS]: one extra slot at position 0, split off below
                last_layer_positions = jnp.concatenate(
                    [jnp.zeros_like(last_layer_positions[:, :1]), last_layer_positions], axis=1)
        x, states = self.encoder(x, bias, deterministic, output_hidden_states, last_layer_positions)
        cls_state = None
        if cls_slot:
            cls_state, x = x[:, 0], x[:, 1:]
            if states is not None:
                states = states[:-1] + (x,)
        elif not gathered:
            cls_state = x[:, 0]
        out = BertOutput(last_hidden_state=x, hidden_states=states)
        if not heads:
            return out
        if cfg.with_mlm_head:
            out = out.replace(mlm_logits=self.mlm_logits(x, mlm_positions, padded_vocab))
        if (cfg.with_pooler or cfg.with_nsp_head) and cls_state is not None:
            pooled = jnp.tanh(self.pooler(cls_state).astype(jnp.float32))
            out = out.replace(pooled=pooled)
            if cfg.with_nsp_head:
                out = out.replace(nsp_logits=self.nsp(pooled))
        return out

    def mlm_logits(self, hidden: jax.Array, positions: jax.Array | None = None,
                   padded_vocab: bool = False) -> jax.Array:
        """``hidden [B, L, H]`` -> f32 logits ``[B, L, V]``, or ``[B, P, V]`` at ``positions [B, P]``
        (transform H -> E, gelu, LayerNorm, tied decoder E -> V).

        ``padded_vocab=True`` returns all ``V_padded`` columns with the padding ones at -1e9 (they
        never win a softmax or an argmax): what the training loss takes, because slicing the
        columns off costs a copy of the logits forward and a padded copy of their gradient.
        """
        cfg = self.config
        if positions is not None:
            hidden = take_positions(hidden, positions)
        h = gelu(self.mlm_transform(hidden))
        h = self.mlm_norm(h)
        bias, padded = self.mlm_bias.astype(jnp.float32), cfg.padded_vocab_size != cfg.vocab_size
        if padded and padded_vocab:
            # Through the bias ([V_padded], not the [.., V_padded] logits): the padding columns
            # get -1e9 inside the decoder's matmul epilogue, and their bias no gradient.
            bias = jnp.where(jnp.arange(bias.shape[0]) < cfg.vocab_size, bias, jnp.float32(-1e9))
        logits = self.embeddings.attend(h, bias)
        if padded and not padded_vocab:
            # Drop the padding rows of the vocabulary: they can never be predicted.
            return logits[..., :cfg.vocab_size]
        return logits
