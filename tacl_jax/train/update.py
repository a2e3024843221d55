"""Gradient accumulation and the optimizer update: the part of a train step every objective shares.

An objective supplies ``loss_and_grads(params, teacher_params, batch, step_rng) -> (loss, sums,
grads)`` for one global batch (built on ``accumulate`` when it splits the batch into
micro-batches) and the function that turns its loss sums into metrics; ``train_step_from``
wraps them into ``train_step(state, teacher_params, batch, rng) -> (state, metrics)``, the
signature ``tacl_jax.train.setup.build_program`` jits for every objective.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tacl_jax.train.state import TrainState


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


def train_step_from(loss_and_grads: Callable, tx: optax.GradientTransformation, schedule: Callable[[Any], Any],
                    to_ratios: Callable[[dict], dict]) -> Callable:
    """The un-jitted ``train_step(state, teacher_params, batch, rng) -> (state, metrics)``: the
    objective's loss and gradients at the key ``rng`` folded with ``state.step`` (masking and
    dropout are a pure function of (seed, step): a resumed run redraws exactly the same), then one
    optimizer update. Metrics: ``loss``, ``grad_norm``, ``param_norm``, ``lr`` (the rate of this
    update), ``masked_tokens`` and ``to_ratios(sums)``."""
    def train_step(state: TrainState, teacher_params, batch: dict, rng: jax.Array):
        loss, sums, grads = loss_and_grads(state.params, teacher_params, batch, jax.random.fold_in(rng, state.step))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads), param_norm=optax.tree.norm(params),
                       lr=jnp.asarray(schedule(state.step), jnp.float32), masked_tokens=sums["n_pred"],
                       **to_ratios(sums))
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


__all__ = ["ACCUM_AXIS", "accumulate", "shard_map_applies", "train_step_from"]
