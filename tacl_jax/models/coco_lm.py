"""COCO-LM's two networks and heads (arXiv 2102.08473).

Parameter tree (one tree, one optimizer)::

    main/...          a BertModel tree with the MLM head: exported as BertForMaskedLM
                      (``hf.save(model.main, params['main'])``); its ``mlm_bias`` is the corrective
                      LM's bias b
    generator/...     a BertModel tree (``generator_layers`` layers, same width, own MLM head)
                      *without* ``embeddings``: it reads ``main/embeddings``
    heads/binary      copy/binary head: Linear(H → 1) on every token
    heads/scl_dense, heads/scl_norm    SCL projection: Linear → GELU → LayerNorm on [CLS]

Shared embeddings: the generator is an ordinary ``BertModel`` applied to its own tree with
``main/embeddings`` put in at call time, so the token, position and token-type embeddings and
their LayerNorm exist once and receive the gradients of both networks (the released COCO-LM
shares the token and position embeddings and the embedding LayerNorm; it has no token types).
The generator's MLM decoder is tied to the same word embeddings.

The corrective LM's logits are ``h·Eᵀ + b`` with the tied word embeddings E and no transform
(the spec, and the released ``CLMHead``); the main model's ``mlm_transform``/``mlm_norm`` are
then unused in training (kept so the export is a complete BertForMaskedLM).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tacl_jax.errors import ConfigError
from tacl_jax.models.bert import BertConfig, BertModel, take_positions, to_dtype
from tacl_jax.models.layers import Dense, LayerNorm, gelu

SAMPLE_MODES = ("eval", "train")


class CocoHeads(nn.Module):
    """The main model's extra heads: the binary (copy) head and the SCL projection."""

    config: BertConfig
    scl_dim: int

    def setup(self):
        cfg = self.config
        dtype, pdtype = to_dtype(cfg.dtype), to_dtype(cfg.param_dtype)
        init = nn.initializers.normal(cfg.initializer_range)
        # One logit per token, in f32 (it is also the CLM's weight).
        self.binary = Dense((cfg.hidden_size,), (1,), ("embed", None), dtype=jnp.float32, param_dtype=pdtype,
                            kernel_init=init, kernels=cfg.kernels)
        self.scl_dense = Dense((cfg.hidden_size,), (self.scl_dim,), ("embed", "embed_out"), dtype=dtype,
                               param_dtype=pdtype, kernel_init=init, kernels=cfg.kernels)
        self.scl_norm = LayerNorm(cfg.layer_norm_eps, jnp.float32, pdtype, axis_name="embed_out")

    def __call__(self, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``hidden [B, L, H]`` -> ``(binary logits [B, L], SCL embedding [B, D])`` (both f32)."""
        return self.binary_logits(hidden), self.scl_embedding(hidden[:, 0])

    def binary_logits(self, hidden: jax.Array) -> jax.Array:
        return self.binary(hidden)[..., 0]

    def scl_embedding(self, cls_hidden: jax.Array) -> jax.Array:
        """``[B, H]`` -> ``[B, D]``, not yet L2-normalised (the loss does it)."""
        return self.scl_norm(gelu(self.scl_dense(cls_hidden)))


@dataclasses.dataclass(frozen=True)
class CocoLM:
    """The generator, the main model and its heads, applied functionally to one parameter tree.

    ``init(rng, input_ids) -> {'params': ...}`` (logically boxed, like a Linen module's), so the
    loop's sharded ``create_state``/``state_shardings`` take it as they take a ``BertModel``;
    ``config`` is the main model's ``BertConfig``.
    """

    main: BertModel
    generator: BertModel
    heads: CocoHeads

    @classmethod
    def build(cls, main_config: BertConfig, generator_layers: int, scl_dim: int = 0) -> "CocoLM":
        if main_config.embed_size != main_config.hidden_size:
            # The corrective LM decodes the main model's H-wide states with the tied E-wide word
            # embeddings, which ELECTRA's factorised embeddings (E != H) cannot take.
            raise ConfigError(f"objective 'coco_lm' needs embeddings as wide as the hidden states; this "
                              f"ELECTRA checkpoint has embedding_size {main_config.embedding_size} != hidden_size "
                              f"{main_config.hidden_size}: use objective 'tacl' or 'mlm', or a checkpoint "
                              "whose embedding_size equals hidden_size")
        cfg = main_config.replace(with_mlm_head=True, with_nsp_head=False)
        gen = cfg.replace(num_hidden_layers=int(generator_layers), with_pooler=False)
        return cls(main=BertModel(cfg), generator=BertModel(gen),
                   heads=CocoHeads(cfg, int(scl_dim) or cfg.hidden_size))

    @property
    def config(self) -> BertConfig:
        return self.main.config

    def init(self, rng: jax.Array, input_ids: jax.Array, *args, **kwargs) -> dict[str, Any]:
        r_main, r_gen, r_heads = jax.random.split(rng, 3)
        main = self.main.init(r_main, input_ids)["params"]
        gen = dict(self.generator.init(r_gen, input_ids)["params"])
        del gen["embeddings"]                         # shared: main/embeddings
        h = jnp.zeros(input_ids.shape + (self.config.hidden_size,), to_dtype(self.config.dtype))
        heads = self.heads.init(r_heads, h)["params"]
        return {"params": {"main": main, "generator": gen, "heads": heads}}

    # --- the pieces the train step composes

    @staticmethod
    def generator_params(params: dict) -> dict:
        """The generator's full ``BertModel`` tree: its own layers and head + the main embeddings."""
        return {**params["generator"], "embeddings": params["main"]["embeddings"]}

    def generator_logits(self, params: dict, input_ids, attention_mask, token_type_ids, positions, *,
                         deterministic: bool, rng: jax.Array | None = None) -> jax.Array:
        """Generator MLM logits ``[B, P, V]`` (f32) at ``positions [B, P]``."""
        out = self.generator.apply({"params": self.generator_params(params)}, input_ids, attention_mask,
                                   token_type_ids, deterministic=deterministic, mlm_positions=positions,
                                   rngs={"dropout": rng} if rng is not None else None)
        return out.mlm_logits

    def main_hidden(self, params: dict, input_ids, attention_mask, token_type_ids, *, deterministic: bool,
                    rng: jax.Array | None = None) -> jax.Array:
        """The main model's final states ``[B, L, H]`` (encoder only)."""
        out = self.main.apply({"params": params["main"]}, input_ids, attention_mask, token_type_ids,
                              deterministic=deterministic, heads=False,
                              rngs={"dropout": rng} if rng is not None else None)
        return out.last_hidden_state

    def clm_logits(self, params: dict, hidden: jax.Array, positions: jax.Array) -> jax.Array:
        """Corrective LM ``h·Eᵀ + b`` at ``positions [B, P]`` -> ``[B, P, V]`` f32 (V unpadded)."""
        h = take_positions(hidden, positions)
        main = params["main"]
        logits = self.main.apply({"params": main}, h, main["mlm_bias"],
                                 method=lambda m, x, b: m.embeddings.attend(x, b))
        return logits[..., :self.config.vocab_size]

    def binary_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``[B, L, H]`` -> ``[B, L]`` f32."""
        return self.heads.apply({"params": params["heads"]}, hidden, method=CocoHeads.binary_logits)

    def scl_embedding(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``[B, L, H]`` -> projected ``[CLS]`` ``[B, D]`` f32 (not normalised)."""
        return self.heads.apply({"params": params["heads"]}, hidden[:, 0], method=CocoHeads.scl_embedding)


__all__ = ["CocoHeads", "CocoLM", "SAMPLE_MODES"]
