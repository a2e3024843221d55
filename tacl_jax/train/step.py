"""The fused train step: masking, the frozen teacher, the student, MLM + TaCL (+ NSP) losses,
gradient accumulation and the optimizer update, as one function for one ``jax.jit``.

``train_step(state, teacher_params, batch, rng) -> (state, metrics)``:

* ``batch``: global arrays ``input_ids``, ``attention_mask``, ``token_type_ids`` (``[B, L]``
  int32), optionally ``word_starts`` ``[B, L]`` and ``next_sentence_label`` ``[B]``;
* ``rng``: the run's base key; the step folds in ``state.step``, so masking and dropout are a
  pure function of (seed, step) and a resumed run redraws exactly the same;
* ``teacher_params``: frozen, a separate argument, never donated; its forward is deterministic
  (unless ``teacher_dropout``, the original's bug kept as an option) on the *original* ids and
  sits under ``stop_gradient``, so XLA keeps none of its activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tacl_jax.models import BertModel
from tacl_jax.objectives import Masked, mask_tokens, objective_sums, ratios, total_loss
from tacl_jax.train.state import TrainState


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


def _split_micro(x: jax.Array, k: int) -> jax.Array:
    """``[B, ...] -> [k, B/k, ...]`` taking rows i, i+k, i+2k, ... into micro-batch i, so every
    data-parallel shard contributes equally to each micro-batch (no resharding)."""
    return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)


# The mesh axis over which gradient accumulation keeps per-device partial gradients (see
# ``accumulate``): pure data parallelism, whose devices hold whole replicas of the parameters.
ACCUM_AXIS = "data"


def accumulate(loss_fn: Callable, params, extra, batch: dict, counts: dict, dropout_rng: jax.Array, k: int, *,
               shard_loss_fn: Callable | None = None):
    """``(loss, sums, grads)`` of one global batch as the sum over ``k`` micro-batches, with the
    gradients reduced across devices **once per step**.

    ``loss_fn(params, extra, mb, counts, rng) -> (loss, sums)`` is one micro-batch's loss (its
    sums divided by the global batch's ``counts``, so the k losses, sums and gradients add up
    to the one-batch ones); ``extra`` is passed through (the frozen teacher, or None); ``batch``
    holds the per-row arrays ``[B, ...]`` of the whole global batch, split here by
    ``_split_micro`` into ``[k, B/k, ...]``; micro-batch i draws dropout from the i-th of
    ``k`` keys split from ``dropout_rng``.

    Why not a plain ``lax.scan`` over the micro-batches: with replicated parameters XLA's
    partitioner all-reduces each micro-batch's weight gradient inside the loop body (k
    all-reduces of every gradient per step). So when the ambient mesh (``jax.set_mesh``) is pure
    data parallelism (``'data'`` > 1, every other axis 1: ``shard_map_applies``) the loop runs
    under ``jax.shard_map`` manual over ``'data'``: each device accumulates the gradient of its
    own rows' loss (a partial sum: the parameters are cast to device-varying, so autodiff
    inserts no reduction) and one ``psum`` after the loop adds the partial gradients, sums and
    losses. Any other mesh (none, one device, ``'fsdp'`` or ``'tensor'`` > 1) runs the plain
    scan, whose gradients XLA reduces per micro-batch: with ``fsdp`` that per-micro-batch
    reduce-scatter is inherent (ZeRO-3 keeps only its shard of a gradient), and a
    ``shard_map`` manual over ``'data'`` alone, the other axes left to the partitioner, crashed
    XLA's SPMD partitioner (jax 0.10.2, a failed CHECK in ``spmd_partitioner_util.cc``) on a
    2×2×2 mesh.

    Inside the ``shard_map`` each device folds its ``'data'`` index into the micro-batch's
    dropout key, so shards draw different masks (the same key would repeat one mask on every
    shard's rows). The sharded step therefore agrees with the unsharded one exactly only without
    dropout, and in distribution with it. ``shard_loss_fn`` replaces ``loss_fn`` there (a loss
    with interactions across rows, e.g. COCO-LM's SCL negatives, gathers over ``ACCUM_AXIS``);
    the logical axis rules lose the ``'data'`` axis there (its split is already manual).
    """
    micro = jax.tree.map(lambda x: _split_micro(x, k), batch)
    rngs = jax.random.split(dropout_rng, k)
    mesh = jax.sharding.get_abstract_mesh()
    if not shard_map_applies(mesh):
        return _scan_micro(loss_fn, params, extra, micro, counts, rngs)

    from jax.sharding import PartitionSpec as P

    from tacl_jax import parallel

    rules = parallel.rules_without(nn.get_logical_axis_rules(), (ACCUM_AXIS,))

    def per_shard(params, extra, micro, counts, rngs):
        with nn.logical_axis_rules(rules):
            loss, sums, grads = _scan_micro(shard_loss_fn or loss_fn, _varying(params), extra, micro, counts, rngs,
                                            shard=jax.lax.axis_index(ACCUM_AXIS))
        return jax.lax.psum((loss, sums, grads), ACCUM_AXIS)

    return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(), P(None, ACCUM_AXIS), P(), P()), out_specs=P(),
                         axis_names={ACCUM_AXIS})(params, extra, micro, counts, rngs)


def shard_map_applies(mesh) -> bool:
    """Whether ``accumulate`` reduces gradients once per step on ``mesh`` (an ``AbstractMesh`` or
    ``Mesh``; empty outside ``jax.set_mesh``): pure data parallelism over ``ACCUM_AXIS``."""
    if mesh.empty or ACCUM_AXIS not in mesh.axis_names or mesh.shape[ACCUM_AXIS] == 1:
        return False
    return all(size == 1 for name, size in mesh.shape.items() if name != ACCUM_AXIS)


def _varying(tree):
    """``tree`` cast to vary over ``ACCUM_AXIS`` (inside the ``shard_map``): a gradient taken
    with respect to a device-varying value stays this device's partial sum, while one taken with
    respect to a replicated value would be ``psum``-ed by autodiff right there."""
    def cast(x):
        aval = jax.typeof(x)
        axes = aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type") else aval.vma   # jax >= 0.10 | older
        return x if ACCUM_AXIS in axes else jax.lax.pcast(x, ACCUM_AXIS, to="varying")
    return jax.tree.map(cast, tree)


def _scan_micro(loss_fn: Callable, params, extra, micro: dict, counts: dict, rngs: jax.Array,
                shard: jax.Array | None = None):
    """The accumulation loop: ``lax.scan`` over ``micro`` (leaves ``[k, b, ...]``) and ``rngs``
    (``[k]`` keys), adding losses, sums and gradients in micro-batch order. ``shard``: this
    device's index over ``ACCUM_AXIS`` inside ``accumulate``'s ``shard_map`` (folded into the
    dropout keys; the carry then varies over that axis), None outside."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(carry, xs):
        g_acc, s_acc, l_acc = carry
        m, r = xs
        if shard is not None:
            r = jax.random.fold_in(r, shard)
        (l, s), g = grad_fn(params, extra, m, counts, r)
        return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, s), l_acc + l), None

    _, sums_shape = jax.eval_shape(loss_fn, params, extra, jax.tree.map(lambda x: x[0], micro), counts, rngs[0])
    init = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape),
            jnp.zeros((), jnp.float32))
    if shard is not None:
        init = _varying(init)
    (grads, sums, loss), _ = jax.lax.scan(body, init, (micro, rngs))
    return loss, sums, grads


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


def make_loss_and_grads(model: BertModel, step_cfg: StepConfig,
                        teacher_model: BertModel | None = None) -> Callable:
    """``loss_and_grads(params, teacher_params, batch, step_rng) -> (loss, sums, grads)``: masking,
    both forwards, the objective and its gradient for one global batch, accumulated over
    ``grad_accum_steps`` micro-batches (``accumulate``: on a data-parallel mesh the gradients
    are reduced across devices once per step, after the loop). ``sums`` are the loss sums and
    counts (see ``objectives.combined``); ``step_rng`` is the run's key already folded with the
    step.

    ``teacher_model`` defaults to ``model``; pass the same architecture without heads (the
    teacher's params then need only the encoder).
    """
    sc = step_cfg
    teacher_model = teacher_model or model
    weights = dict(sc.weights)
    vocab_size = model.config.vocab_size

    def loss_fn(params, teacher_params, mb, counts, dropout_rng):
        d_student, d_teacher = jax.random.split(dropout_rng)
        teacher_hidden = None
        if sc.uses_teacher:
            t = teacher_model.apply({"params": teacher_params}, mb["input_ids"], mb["attention_mask"],
                                    mb["token_type_ids"], deterministic=not sc.teacher_dropout, heads=False,
                                    rngs={"dropout": d_teacher})
            teacher_hidden = jax.lax.stop_gradient(t.last_hidden_state)
        out = student_forward(model, sc, params, mb["masked_ids"], mb["attention_mask"], mb["token_type_ids"],
                              mb["positions"], deterministic=False, padded_vocab=True,
                              rngs={"dropout": d_student})
        sums = objective_sums(
            mlm_logits=out.mlm_logits, masked=_masked_from(mb), student_hidden=out.last_hidden_state,
            teacher_hidden=teacher_hidden, key_mask=mb["attention_mask"] if sc.mask_pad_keys else None,
            temperature=sc.temperature, nsp_logits=out.nsp_logits if sc.nsp else None,
            nsp_labels=mb.get("next_sentence_label"), student_at_slots=sc.gather_last_layer,
            anchor_mask=mb["attention_mask"] if sc.anchors == "all" else None)
        return total_loss(sums, counts, weights), sums

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, teacher_params, batch: dict, step_rng: jax.Array):
        mask_rng, dropout_rng = jax.random.split(step_rng)
        masked = mask_tokens(mask_rng, batch["input_ids"], batch["attention_mask"],
                             max_predictions=sc.max_predictions, mask_id=sc.mask_id, vocab_size=vocab_size,
                             special_ids=sc.special_ids, mask_prob=sc.mask_prob, replace_prob=sc.replace_prob,
                             random_prob=sc.random_prob,
                             word_starts=batch.get("word_starts") if sc.whole_word else None, budget=sc.budget)
        mb = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  token_type_ids=batch["token_type_ids"], masked_ids=masked.input_ids, selected=masked.selected,
                  positions=masked.positions, targets=masked.targets, weights=masked.weights)
        if sc.nsp:
            mb["next_sentence_label"] = batch["next_sentence_label"]
        # Denominators of the whole global batch: each micro-batch's loss is its sum divided by
        # these, so accumulated gradients are weighted by token count exactly.
        anchors = batch["attention_mask"] if sc.anchors == "all" else masked.selected
        counts = dict(n_pred=masked.weights.sum(), n_anchor=anchors.sum().astype(jnp.float32),
                      n_seq=jnp.asarray(batch["input_ids"].shape[0], jnp.float32))
        k = sc.grad_accum_steps
        if k == 1:
            (loss, sums), grads = grad_fn(params, teacher_params, mb, counts, dropout_rng)
            return loss, sums, grads
        return accumulate(loss_fn, params, teacher_params, mb, counts, dropout_rng, k)

    return loss_and_grads


def make_train_step(model: BertModel, step_cfg: StepConfig, tx: optax.GradientTransformation,
                    schedule: Callable[[Any], Any], teacher_model: BertModel | None = None) -> Callable:
    """Returns the un-jitted ``train_step``; ``tacl_jax.train.loop`` jits it with shardings."""
    loss_and_grads = make_loss_and_grads(model, step_cfg, teacher_model)

    def train_step(state: TrainState, teacher_params, batch: dict, rng: jax.Array):
        loss, sums, grads = loss_and_grads(state.params, teacher_params, batch, jax.random.fold_in(rng, state.step))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads), param_norm=optax.tree.norm(params),
                       lr=jnp.asarray(schedule(state.step), jnp.float32), masked_tokens=sums["n_pred"],
                       **ratios(sums))
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(model: BertModel, step_cfg: StepConfig, teacher_model: BertModel):
    """Deterministic forward on held-out batches with a fixed mask key: the loss sums, so numbers
    compare across runs and steps."""
    def eval_step(params, teacher_params, batch, rng):
        masked = mask_tokens(rng, batch["input_ids"], batch["attention_mask"],
                             max_predictions=step_cfg.max_predictions, mask_id=step_cfg.mask_id,
                             vocab_size=model.config.vocab_size, special_ids=step_cfg.special_ids,
                             mask_prob=step_cfg.mask_prob, replace_prob=step_cfg.replace_prob,
                             random_prob=step_cfg.random_prob,
                             word_starts=batch.get("word_starts") if step_cfg.whole_word else None,
                             budget=step_cfg.budget)
        out = student_forward(model, step_cfg, params, masked.input_ids, batch["attention_mask"],
                              batch["token_type_ids"], masked.positions, deterministic=True)
        teacher_hidden = None
        if teacher_params is not None:
            teacher_hidden = teacher_model.apply({"params": teacher_params}, batch["input_ids"],
                                                 batch["attention_mask"], batch["token_type_ids"],
                                                 deterministic=True, heads=False).last_hidden_state
        return objective_sums(mlm_logits=out.mlm_logits, masked=masked, student_hidden=out.last_hidden_state,
                              teacher_hidden=teacher_hidden,
                              key_mask=batch["attention_mask"] if step_cfg.mask_pad_keys else None,
                              temperature=step_cfg.temperature, student_at_slots=step_cfg.gather_last_layer,
                              anchor_mask=batch["attention_mask"] if step_cfg.anchors == "all" else None)
    return eval_step


def _masked_from(mb: dict) -> Masked:
    return Masked(input_ids=mb["masked_ids"], selected=mb["selected"], positions=mb["positions"],
                  targets=mb["targets"], weights=mb["weights"])


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


__all__: Sequence[str] = ("StepConfig", "student_forward", "make_loss_and_grads", "make_train_step", "make_eval_step",
                          "step_config_from", "accumulate", "shard_map_applies")
