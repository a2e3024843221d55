"""COCO-LM's fused train step (arXiv 2102.08473, as its authors' code computes it): masking, the
generator's MLM, sampling the corruption, the main model on the corrupted and the cropped views,
the binary, CLM and SCL losses, gradient accumulation and one optimizer update of both networks, for one
``jax.jit``.

``train_step(state, teacher_params, batch, rng) -> (state, metrics)``, the TaCL step's signature
(``teacher_params`` is ignored: pass None). ``batch``: global ``input_ids``, ``attention_mask``,
``token_type_ids`` ``[B, L]`` int32 (optionally ``word_starts``). ``rng``: the run's base key;
the step folds in ``state.step``.

Randomness that decides *what* is computed (the mask, the sampling uniforms, the crop starts) is
drawn for the whole global batch before the micro-batch split, so k micro-batches see exactly
what one batch sees; only dropout is drawn per micro-batch (and, where ``update.accumulate`` runs
the loop under ``shard_map``, per data shard: exact agreement with one device then needs
dropout off). The generator's gradient never flows through the sampling: the samples are
integers drawn from a pass under ``stop_gradient``; the two networks interact only through the
shared embeddings.

SCL negatives (``coco_lm.scl_group_size`` = G > 0): within fixed groups of G sequences of the
step's global batch, rows ``[g·G, (g+1)·G)``, the same groups on any mesh and with any
``grad_accum_steps`` (the posted loss takes them from each GPU's local batch: 16 sequences in the
reconstructed recipe). With k micro-batches each group must lie in one of them, so B/k must be a
multiple of G (``coco_step_config_from`` says so); ``_group_micro_order`` then orders the rows so
that ``update.accumulate``'s split hands out whole groups, each data shard's from its own rows when
B/(k·shards) is a multiple of G as well (no communication: each device's SCL is local). G = 0:
the whole (micro-)batch being computed, B/k sequences, gathered across the data shards.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from tacl_jax import flops as flops_lib
from tacl_jax.errors import ConfigError
from tacl_jax.models import BertConfig
from tacl_jax.models.coco_lm import SAMPLE_MODES, CocoLM
from tacl_jax.objectives import mask_tokens, num_predictions
from tacl_jax.objectives.coco_lm import (CLM_FORMS, TERMS, coco_ratios, coco_sums, coco_total, corrupt, crop_views,
                                         nt_xent_per_view, sample_tokens)
from tacl_jax.train.update import ACCUM_AXIS, accumulate, train_step_from

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CocoStepConfig:
    """Everything the COCO-LM step needs besides arrays; built by ``coco_step_config_from``."""

    max_predictions: int
    mask_id: int
    cls_id: int
    pad_id: int
    special_ids: tuple[int, ...]
    mask_prob: float = 0.15
    replace_prob: float = 1.0            # COCO-LM: every selected token → [MASK]
    random_prob: float = 0.0
    whole_word: bool = False
    sample_mode: str = "eval"
    crop_fraction: float = 0.9
    temperature: float = 1.0
    scl_group_size: int = 16             # SCL negatives within groups of this many rows; 0 = the micro-batch
    clm_form: str = "weighted_ce"        # objectives.coco_lm.CLM_FORMS
    weights: tuple[tuple[str, float], ...] = (("binary", 50.0), ("clm", 1.0), ("gen_mlm", 1.0), ("scl", 1.0))
    grad_accum_steps: int = 1

    def __post_init__(self):
        if self.sample_mode not in SAMPLE_MODES:
            raise ValueError(f"coco_lm.generator_sample_mode={self.sample_mode!r}: use one of {SAMPLE_MODES}")
        if self.clm_form not in CLM_FORMS:
            raise ValueError(f"coco_lm.clm_form={self.clm_form!r}: use one of {CLM_FORMS}")
        if self.scl_group_size < 0:
            raise ValueError(f"coco_lm.scl_group_size={self.scl_group_size}: use 0 (the whole micro-batch) or more")
        unknown = set(dict(self.weights)) - set(TERMS)
        if unknown:
            raise ValueError(f"coco_lm.loss_weights has unknown terms {sorted(unknown)}; known: {sorted(TERMS)}")


def coco_step_config_from(config, special: dict[str, int], mesh=None) -> CocoStepConfig:
    """From the run's config (``config.masking``, ``config.coco_lm``) and the special ids.
    ``mesh`` is accepted for the callers and not needed: the SCL groups do not depend on it.
    A ``ConfigError`` names the fix when the micro-batch does not split into SCL groups."""
    del mesh
    m, c = config.masking, config.coco_lm
    if "scl_negatives" in c:
        raise ConfigError(f"coco_lm.scl_negatives={c.scl_negatives!r} was replaced by coco_lm.scl_group_size "
                          "(negatives within fixed groups of that many sequences, the same on any mesh): "
                          "'global' is scl_group_size=0; for 'local' set scl_group_size to the rows per device "
                          "per micro-batch (the posted recipe's 16); remove scl_negatives")
    if c.generator_layers < 1 or not 0 < c.crop_fraction <= 1 or c.temperature <= 0:
        raise ValueError("coco_lm: need generator_layers >= 1, 0 < crop_fraction <= 1 and temperature > 0")
    if m.replace_prob != 1.0:
        log.warning("COCO-LM masks every selected token with [MASK]; config.masking.replace_prob=%s "
                    "(the COCO-LM configs set 1.0)", m.replace_prob)
    g = int(c.scl_group_size)
    if g < 0:
        raise ConfigError(f"coco_lm.scl_group_size={g}: use 0 (the whole micro-batch) or a group size >= 1")
    if g and c.loss_weights.get("scl", 0.0):
        check_scl_groups(config.global_batch_size, config.grad_accum_steps, g)
    max_pred = m.max_predictions if m.max_predictions > 0 else num_predictions(config.max_len, m.mask_prob)
    return CocoStepConfig(
        max_predictions=int(max_pred), mask_id=int(special["mask"]), cls_id=int(special["cls"]),
        pad_id=int(special["pad"]), special_ids=tuple(int(special[k]) for k in ("pad", "cls", "sep", "mask", "unk")),
        mask_prob=m.mask_prob, replace_prob=m.replace_prob, random_prob=m.random_prob, whole_word=m.whole_word,
        sample_mode=c.generator_sample_mode, crop_fraction=c.crop_fraction, temperature=c.temperature,
        scl_group_size=g, clm_form=c.clm_form, weights=tuple(sorted(dict(c.loss_weights).items())),
        grad_accum_steps=config.grad_accum_steps)


def check_scl_groups(batch: int, k: int, group_size: int) -> None:
    """``ConfigError`` unless each of the ``k`` micro-batches of a global batch of ``batch`` rows
    holds whole SCL groups of ``group_size`` (``(batch / k) % group_size == 0``), naming the fix."""
    if batch % k or (batch // k) % group_size == 0:
        return                    # batch % k: config.validate's error
    ks = [d for d in range(1, batch + 1) if batch % d == 0 and (batch // d) % group_size == 0]
    fix = (f"use grad_accum_steps in {ks} (micro-batches of {', '.join(str(batch // d) for d in ks)})" if ks else
           f"use a global_batch_size that is a multiple of {group_size}")
    raise ConfigError(f"coco_lm.scl_group_size={group_size}: a micro-batch of {batch // k} sequences "
                      f"(global_batch_size {batch} / grad_accum_steps {k}) does not hold whole SCL negative groups "
                      f"of {group_size} (each group must lie in one micro-batch); {fix}, or set "
                      f"coco_lm.scl_group_size to a divisor of {batch // k} (0 = the whole micro-batch)")


# ----------------------------------------------------------------------------- the step

def prepare_batch(model: CocoLM, sc: CocoStepConfig, batch: dict, step_rng: jax.Array) -> dict:
    """Everything random that is not dropout, for the whole global batch: the mask, one sampling
    uniform per slot and the crop view. Returns the per-row arrays the loss reads."""
    mask_rng, u_rng, crop_rng = jax.random.split(step_rng, 3)
    masked = mask_tokens(mask_rng, batch["input_ids"], batch["attention_mask"],
                         max_predictions=sc.max_predictions, mask_id=sc.mask_id, vocab_size=model.config.vocab_size,
                         special_ids=sc.special_ids, mask_prob=sc.mask_prob, replace_prob=sc.replace_prob,
                         random_prob=sc.random_prob,
                         word_starts=batch.get("word_starts") if sc.whole_word else None)
    b = batch["input_ids"].shape[0]
    crop = crop_views(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                      jax.random.uniform(crop_rng, (b,)), fraction=sc.crop_fraction, cls_id=sc.cls_id,
                      pad_id=sc.pad_id)
    return dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                token_type_ids=batch["token_type_ids"], masked_ids=masked.input_ids, positions=masked.positions,
                targets=masked.targets, weights=masked.weights,
                sample_u=jax.random.uniform(u_rng, masked.positions.shape),
                crop_ids=crop["input_ids"], crop_mask=crop["attention_mask"], crop_types=crop["token_type_ids"])


def make_coco_loss_fn(model: CocoLM, sc: CocoStepConfig, deterministic: bool = False,
                      data_axis: str | None = None) -> Callable:
    """``loss_fn(params, mb, counts, dropout_rng) -> (loss, sums)`` for one micro-batch ``mb``
    (from ``prepare_batch``); ``counts`` = the global batch's ``n_pred``, ``n_tok``, ``n_view``.
    ``deterministic``: dropout off in the training passes (evaluation). ``data_axis``: the loss
    runs inside a ``shard_map`` manual over this mesh axis, on one shard's rows of the
    micro-batch (``update.accumulate``); the SCL term then sees the negatives it would see on the
    whole micro-batch (``_scl_sums_of_shard``) and every other term is a per-row sum."""
    weights = dict(sc.weights)
    det = deterministic
    use_scl = weights.get("scl", 0.0) != 0.0

    def loss_fn(params, mb, counts, dropout_rng):
        d_gen, d_main = jax.random.split(dropout_rng)
        # 1. Generator MLM on the [MASK]ed input (with dropout, with gradient).
        gen_logits = model.generator_logits(params, mb["masked_ids"], mb["attention_mask"], mb["token_type_ids"],
                                            mb["positions"], deterministic=det, rng=d_gen)
        # 2. Corruption: sample from a pass without gradient (and, by default, without dropout).
        if sc.sample_mode == "eval":
            sample_logits = model.generator_logits(jax.lax.stop_gradient(params), mb["masked_ids"],
                                                   mb["attention_mask"], mb["token_type_ids"], mb["positions"],
                                                   deterministic=True)
        else:
            sample_logits = jax.lax.stop_gradient(gen_logits)
        samples = sample_tokens(sample_logits, mb["sample_u"])
        x_corr, replaced = corrupt(mb["masked_ids"], mb["positions"], mb["weights"], samples, mb["input_ids"],
                                   mb["attention_mask"])
        # 3. The main model on the corrupted and (for SCL) the cropped views, as one batch of 2b
        #    rows interleaved (corrupted_i, crop_i) so each data shard keeps its own rows.
        if use_scl:
            inter = lambda a, c: jnp.stack([a, c], axis=1).reshape((-1,) + a.shape[1:])
            hidden = model.main_hidden(params, inter(x_corr, mb["crop_ids"]),
                                       inter(mb["attention_mask"], mb["crop_mask"]),
                                       inter(mb["token_type_ids"], mb["crop_types"]), deterministic=det, rng=d_main)
            hidden = hidden.reshape((-1, 2) + hidden.shape[1:])
            h_corr, h_crop = hidden[:, 0], hidden[:, 1]
        else:
            h_corr = model.main_hidden(params, x_corr, mb["attention_mask"], mb["token_type_ids"],
                                       deterministic=det, rng=d_main)
        binary_logits = model.binary_logits(params, h_corr)
        clm_logits = model.clm_logits(params, h_corr, mb["positions"])
        scl_q = scl_k = None
        if use_scl:
            scl_q, scl_k = model.scl_embedding(params, h_crop), model.scl_embedding(params, h_corr)
        sharded_scl = use_scl and data_axis is not None
        sums = coco_sums(gen_logits=gen_logits, targets=mb["targets"], weights=mb["weights"], replaced=replaced,
                         attention_mask=mb["attention_mask"], binary_logits=binary_logits, clm_logits=clm_logits,
                         positions=mb["positions"], scl_q=None if sharded_scl else scl_q,
                         scl_k=None if sharded_scl else scl_k, temperature=sc.temperature,
                         scl_group_size=sc.scl_group_size, clm_form=sc.clm_form)
        if sharded_scl:
            sums.update(_scl_sums_of_shard(scl_q, scl_k, sc.temperature, sc.scl_group_size, data_axis))
        return coco_total(sums, counts, weights), sums

    return loss_fn


def _scl_sums_of_shard(q: jax.Array, k: jax.Array, temperature: float, group_size: int, axis: str) -> dict:
    """SCL sums (``scl_nll``, ``scl_correct``, ``n_view``) of this shard's views, inside a
    ``shard_map`` manual over ``axis`` whose shards hold contiguous row blocks ``q, k [b, D]``
    of the micro-batch. Negatives as on the whole micro-batch (groups of ``group_size`` of its
    rows, 0 = all): when ``b`` is a multiple of the group size each group lies in this shard's
    rows (no communication; ``_group_micro_order`` arranges it where it can); otherwise the
    views of every shard are all-gathered (``[B/k, D]`` f32, 0.2 MB per view for coco_lm_base
    with G = 0; autodiff returns each shard its rows' cotangents by a reduce-scatter) and this
    shard's anchors kept. Summed over the shards: ``coco_sums``'s SCL terms on the whole
    micro-batch."""
    b = q.shape[0]
    if group_size and b % group_size == 0:
        nll, correct = nt_xent_per_view(q, k, temperature, group_size)
    else:
        gather = lambda x: jax.lax.all_gather(x, axis, tiled=True)
        nll, correct = nt_xent_per_view(gather(q), gather(k), temperature, group_size)
        mine = lambda x: jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * b, b, axis=1)
        nll, correct = mine(nll), mine(correct)
    return dict(scl_nll=nll.sum(), scl_correct=correct.sum(), n_view=jnp.asarray(nll.size, jnp.float32))


def _batch_shards() -> int:
    """Row shards of the batch on the ambient mesh (``data`` × ``fsdp``; 1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    shape = dict(mesh.shape)
    return int(shape.get("data", 1)) * int(shape.get("fsdp", 1))


def _group_micro_order(mb: dict, k: int, group_size: int, shards: int) -> dict:
    """The rows of the global batch ``mb`` (leaves ``[B, ...]``) reordered so that
    ``update.accumulate``'s strided split (micro-batch i = rows i, i+k, i+2k, ...) yields micro-batches
    of whole SCL groups: rows viewed as ``[c, k, B/(c·k)]`` blocks, micro-batch i = the blocks
    ``[:, i]``, with ``B/(c·k)`` a multiple of ``group_size`` so each contiguous group
    ``[g·G, (g+1)·G)`` lies in one block. ``c`` = the largest divisor of ``shards`` that allows it:
    with ``c = shards`` every block is inside one device's rows (the permutation is local: no
    communication, and each device's share of a micro-batch is one block); ``c = 1`` (micro-batch
    i = rows ``[i·B/k, (i+1)·B/k)``) always works once ``(B/k) % G == 0``."""
    b = jax.tree.leaves(mb)[0].shape[0]
    ok = [c for c in range(1, shards + 1)
          if shards % c == 0 and b % (c * k) == 0 and (b // (c * k)) % group_size == 0]
    if not ok:
        raise ValueError(f"coco_lm.scl_group_size={group_size}: a micro-batch of {b // k} rows (batch {b} / "
                         f"grad_accum_steps {k}) does not hold whole SCL groups")
    c = max(ok)
    return jax.tree.map(lambda x: x.reshape((c, k, b // (c * k)) + x.shape[1:]).swapaxes(1, 2).reshape(x.shape), mb)


def _counts(mb: dict) -> dict[str, jax.Array]:
    """Denominators of the whole global batch: masked slots, real tokens, SCL views (2B)."""
    return dict(n_pred=mb["weights"].sum(), n_tok=mb["attention_mask"].sum().astype(jnp.float32),
                n_view=jnp.asarray(2 * mb["input_ids"].shape[0], jnp.float32))


def make_coco_loss_and_grads(model: CocoLM, sc: CocoStepConfig) -> Callable:
    """``loss_and_grads(params, teacher_params, batch, step_rng) -> (loss, sums, grads)`` for one
    global batch (``teacher_params`` is ignored: COCO-LM has no teacher),
    accumulated over ``grad_accum_steps`` micro-batches with global-count denominators
    (``update.accumulate``: the gradients are reduced across data-parallel devices once per
    step; with SCL groups the rows are first ordered by ``_group_micro_order``, and each
    device's loss sees the negatives of its groups, ``_scl_sums_of_shard``)."""
    loss_fn = make_coco_loss_fn(model, sc)
    shard_loss_fn = make_coco_loss_fn(model, sc, data_axis=ACCUM_AXIS)
    use_scl = dict(sc.weights).get("scl", 0.0) != 0.0
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, teacher_params, batch: dict, step_rng: jax.Array):
        del teacher_params
        prep_rng, dropout_rng = jax.random.split(step_rng)
        mb = prepare_batch(model, sc, batch, prep_rng)
        counts = _counts(mb)
        k = sc.grad_accum_steps
        if k == 1:
            (loss, sums), grads = grad_fn(params, mb, counts, dropout_rng)
            return loss, sums, grads
        if use_scl and sc.scl_group_size:
            mb = _group_micro_order(mb, k, sc.scl_group_size, _batch_shards())
        return accumulate(lambda p, _, m, c, r: loss_fn(p, m, c, r), params, None, mb, counts, dropout_rng, k,
                          shard_loss_fn=lambda p, _, m, c, r: shard_loss_fn(p, m, c, r))

    return loss_and_grads


def make_coco_train_step(model: CocoLM, sc: CocoStepConfig, tx: optax.GradientTransformation,
                         schedule: Callable[[Any], Any]) -> Callable:
    """The un-jitted ``train_step(state, teacher_params, batch, rng) -> (state, metrics)``;
    ``teacher_params`` is ignored (COCO-LM has no teacher). Metrics: ``loss`` (the total),
    ``gen_mlm_loss``, ``gen_acc``, ``binary_loss``, ``binary_acc``, ``clm_loss``, ``clm_acc``,
    ``scl_loss``, ``scl_acc``, ``replaced_frac``, ``grad_norm``, ``param_norm``, ``lr``,
    ``masked_tokens``."""
    return train_step_from(make_coco_loss_and_grads(model, sc), tx, schedule, coco_ratios)


def make_coco_eval_step(model: CocoLM, sc: CocoStepConfig) -> Callable:
    """``eval_step(params, teacher_params, batch, rng) -> sums``, dropout off, for the loop's
    ``evaluate`` (which sums them over batches; ``coco_ratios`` turns the totals into metrics)."""
    loss_fn = make_coco_loss_fn(model, sc, deterministic=True)

    def eval_step(params, teacher_params, batch, rng):
        del teacher_params
        mb = prepare_batch(model, sc, batch, rng)
        return loss_fn(params, mb, _counts(mb), rng)[1]

    return eval_step


def coco_step_flops(model: CocoLM, sc: CocoStepConfig, *, batch: int, length: int) -> float:
    """Model FLOPs of one COCO-LM optimizer step (conventions of ``tacl_jax.flops``): generator
    forward + backward (+ one more forward when sampling in 'eval' mode) with its MLM head on
    the P slots; the main model forward + backward on the corrupted and the cropped views, with
    the tied CLM decoder on the slots."""
    m, g = model.main.config, model.generator.config
    tokens, slots = batch * length, batch * sc.max_predictions
    enc_g = flops_lib.encoder_flops_per_token(g.num_hidden_layers, g.hidden_size, g.intermediate_size, length)
    enc_m = flops_lib.encoder_flops_per_token(m.num_hidden_layers, m.hidden_size, m.intermediate_size, length)
    gen_fwd = enc_g * tokens + flops_lib.mlm_head_flops(g.hidden_size, g.vocab_size) * slots
    views = 2 if dict(sc.weights).get("scl", 0.0) else 1
    main_fwd = views * enc_m * tokens + 2 * m.hidden_size * m.vocab_size * slots + 2 * m.hidden_size * tokens
    return float(3 * gen_fwd + (gen_fwd if sc.sample_mode == "eval" else 0.0) + 3 * main_fwd)


class CocoObjective:
    """``objective='coco_lm'`` for ``tacl_jax.train.objective``: the generator and the main model
    trained together; the main model is the BERT loaded from and exported to Hugging Face."""

    name = "coco_lm"
    bert_at = "main"
    console_keys = ("loss", "gen_mlm_loss", "binary_loss", "binary_acc", "clm_loss", "scl_loss", "scl_acc")

    def build_model(self, config, bert: BertConfig) -> CocoLM:
        return CocoLM.build(bert.replace(with_pooler=False), config.coco_lm.generator_layers, config.coco_lm.scl_dim)

    def step_config(self, config, special_ids: dict[str, int]) -> CocoStepConfig:
        return coco_step_config_from(config, special_ids)

    def teacher_model(self, model, step_cfg) -> None:
        return None

    def has_own_teacher(self, config) -> bool:
        return False

    def teacher_params(self, config, teacher_model) -> dict:
        raise ValueError("COCO-LM has no teacher")

    def train_step(self, model, step_cfg, tx, schedule, teacher_model) -> Callable:
        return make_coco_train_step(model, step_cfg, tx, schedule)

    def eval_step(self, model, step_cfg, teacher_model) -> Callable:
        return make_coco_eval_step(model, step_cfg)

    def ratios(self, sums: dict) -> dict:
        return coco_ratios(sums)

    def flops(self, model: CocoLM, step_cfg: CocoStepConfig, *, batch: int, length: int) -> float:
        return coco_step_flops(model, step_cfg, batch=batch, length=length)


COCO_LM = CocoObjective()

__all__ = ["CocoStepConfig", "coco_step_config_from", "check_scl_groups", "prepare_batch", "make_coco_loss_fn",
           "make_coco_loss_and_grads", "make_coco_train_step", "make_coco_eval_step", "coco_step_flops",
           "CocoObjective", "COCO_LM"]
