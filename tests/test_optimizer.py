"""The fused AdamW (tacl_jax.train.optimizer.fused_adamw) against optax's chain: the same updates,
moments and counts step after step, the same state layout (a checkpoint resumes under either)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tacl_jax.train.optimizer import fused_adamw, learning_rate_schedule, make_optimizer, optax_adamw


def _params(key):
    k = jax.random.split(key, 4)
    return {"layer": {"kernel": jax.random.normal(k[0], (16, 8)), "bias": jax.random.normal(k[1], (8,))},
            "ln": {"scale": 1 + 0.1 * jax.random.normal(k[2], (8,))},
            "embed": jax.random.normal(k[3], (32, 16))}


def _grads(key, params, scale):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten([scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def _run(tx, params, steps, grad_scales, state=None):
    state = tx.init(params) if state is None else state
    update = jax.jit(tx.update)
    for i in range(steps):
        grads = _grads(jax.random.key(100 + i), params, grad_scales[i % len(grad_scales)])
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("clip_norm", [1.0, 0.0])
def test_fused_equals_optax_chain(clip_norm):
    schedule = learning_rate_schedule(1e-2, total_steps=12, warmup_steps=3)
    kw = dict(b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.05, clip_norm=clip_norm)
    params = _params(jax.random.key(0))
    # Gradient norms ~0.1 and ~30: clipping both off and on (with clip_norm 1).
    ref_p, ref_s = _run(optax_adamw(schedule, **kw), params, 8, [0.02, 6.0])
    p, s = _run(fused_adamw(schedule, **kw), params, 8, [0.02, 6.0])
    assert jax.tree.structure(s) == jax.tree.structure(ref_s)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((ref_p, ref_s))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)))
    assert moved > 1e-3                      # the update did something


def test_weight_decay_only_on_matrices():
    schedule = optax.constant_schedule(0.1)
    tx = fused_adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.5, clip_norm=0.0)
    params = _params(jax.random.key(1))
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)      # zero gradients: only the decay moves
    np.testing.assert_allclose(updates["layer"]["kernel"], -0.1 * 0.5 * params["layer"]["kernel"], rtol=1e-6)
    np.testing.assert_allclose(updates["embed"], -0.1 * 0.5 * params["embed"], rtol=1e-6)
    assert not np.any(np.asarray(updates["layer"]["bias"])) and not np.any(np.asarray(updates["ln"]["scale"]))


def test_state_interchanges_with_optax():
    """A run that switches optimizer implementation mid-way (as a checkpoint restored with the
    other ``optim.fused``) equals one that never switched."""
    schedule = learning_rate_schedule(1e-2, total_steps=10, warmup_steps=2)
    kw = dict(b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01, clip_norm=1.0)
    params = _params(jax.random.key(2))
    ref_p, ref_s = _run(optax_adamw(schedule, **kw), params, 6, [0.5, 3.0])
    mid_p, mid_s = _run(fused_adamw(schedule, **kw), params, 3, [0.5, 3.0])
    # Steps 3..5 with optax from the fused state (the gradient keys continue from step 3).
    tx = optax_adamw(schedule, **kw)
    update = jax.jit(tx.update)
    p, s = mid_p, mid_s
    for i in range(3, 6):
        updates, s = update(_grads(jax.random.key(100 + i), p, [0.5, 3.0][i % 2]), s, p)
        p = optax.apply_updates(p, updates)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((ref_p, ref_s))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_make_optimizer_switch_and_errors():
    cfg = ml_collections.ConfigDict(dict(learning_rate=1e-3, warmup_steps=0, warmup_fraction=0.0, weight_decay=0.0,
                                         b1=0.9, b2=0.999, eps=1e-8, clip_norm=1.0))
    params = _params(jax.random.key(3))
    grads = _grads(jax.random.key(4), params, 1.0)
    outs = []
    for fused in (None, True, False):                 # absent key = fused (older configs)
        c = ml_collections.ConfigDict(cfg.to_dict())
        if fused is not None:
            c.fused = fused
        tx, _ = make_optimizer(c, total_steps=10)
        outs.append(tx.update(grads, tx.init(params), params)[0])
    for other in outs[1:]:
        for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(other)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    tx, _ = make_optimizer(cfg, total_steps=10)
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(grads, tx.init(params))
