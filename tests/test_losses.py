"""The losses against naive numpy loops (per anchor, per key)."""

import jax.numpy as jnp
import numpy as np
import pytest

from tacl_jax.objectives import mlm_loss, token_contrastive_at, token_contrastive_loss


def _naive_tacl(hs, ht, selected, key_mask, tau):
    losses, hits = [], []
    for b in range(hs.shape[0]):
        for i in range(hs.shape[1]):
            if not selected[b, i]:
                continue
            a = hs[b, i] / np.linalg.norm(hs[b, i])
            scores = []
            keys = []
            for j in range(ht.shape[1]):
                if key_mask is not None and not key_mask[b, j]:
                    continue
                t = ht[b, j] / np.linalg.norm(ht[b, j])
                scores.append(float(a @ t) / tau)
                keys.append(j)
            scores = np.array(scores, np.float64)
            m = scores.max()
            logz = m + np.log(np.exp(scores - m).sum())
            losses.append(logz - scores[keys.index(i)])
            hits.append(keys[int(np.argmax(scores))] == i)
    return np.mean(losses), np.mean(hits)


@pytest.mark.parametrize("with_key_mask", [False, True])
@pytest.mark.parametrize("tau", [0.01, 0.5])
def test_token_contrastive_loss_matches_naive_loop(with_key_mask, tau):
    rng = np.random.default_rng(0)
    b, length, h = 3, 9, 16
    ht = rng.normal(size=(b, length, h)).astype(np.float32)
    hs = (ht + rng.normal(size=(b, length, h)) * 1.5).astype(np.float32)  # related but not equal
    selected = rng.random((b, length)) < 0.4
    selected[:, 0] = True
    key_mask = np.ones((b, length), bool)
    key_mask[1, 6:] = False  # a padded row
    selected[1, 6:] = False
    km = key_mask if with_key_mask else None
    loss, acc = token_contrastive_loss(jnp.asarray(hs), jnp.asarray(ht), jnp.asarray(selected),
                                       None if km is None else jnp.asarray(km), tau)
    ref_loss, ref_acc = _naive_tacl(hs, ht, selected, km, tau)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(float(acc), ref_acc, atol=1e-6)
    assert 0.0 < ref_acc < 1.0, "the example should have both hits and misses"


@pytest.mark.parametrize("with_key_mask", [False, True])
def test_token_contrastive_at_slots_matches_naive_loop(with_key_mask):
    """The gathered form (student states only at the anchors' slots, ``[B, P, H]``) against the
    same per-anchor loop; padding slots (weight 0) point at position 0 and must not count."""
    rng = np.random.default_rng(3)
    b, length, h, p = 3, 10, 8, 4
    ht = rng.normal(size=(b, length, h)).astype(np.float32)
    hs = (ht + rng.normal(size=(b, length, h)) * 1.5).astype(np.float32)
    positions = np.zeros((b, p), np.int32)
    weights = np.zeros((b, p), np.float32)
    selected = np.zeros((b, length), bool)
    for i, pos in enumerate(([1, 4, 7, 8], [2, 5], [0, 3, 9])):
        positions[i, :len(pos)], weights[i, :len(pos)], selected[i, pos] = pos, 1.0, True
    key_mask = np.ones((b, length), bool)
    key_mask[1, 7:] = False
    km = key_mask if with_key_mask else None
    anchors = np.take_along_axis(hs, positions[..., None], axis=1)
    nll, correct = token_contrastive_at(jnp.asarray(anchors), jnp.asarray(ht), jnp.asarray(positions),
                                        None if km is None else jnp.asarray(km), 0.05)
    loss = float((np.asarray(nll) * weights).sum() / weights.sum())
    acc = float((np.asarray(correct) * weights).sum() / weights.sum())
    ref_loss, ref_acc = _naive_tacl(hs, ht, selected, km, 0.05)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(acc, ref_acc, atol=1e-6)
    assert 0.0 < ref_acc < 1.0, "the example should have both hits and misses"


def test_key_mask_changes_the_loss():
    """Masking pad keys must actually remove them from the softmax."""
    rng = np.random.default_rng(1)
    ht = rng.normal(size=(2, 8, 4)).astype(np.float32)
    hs = rng.normal(size=(2, 8, 4)).astype(np.float32)
    sel = np.zeros((2, 8), bool)
    sel[:, :3] = True
    km = np.ones((2, 8), bool)
    km[:, 5:] = False
    a, _ = token_contrastive_loss(jnp.asarray(hs), jnp.asarray(ht), jnp.asarray(sel), None, 0.1)
    b, _ = token_contrastive_loss(jnp.asarray(hs), jnp.asarray(ht), jnp.asarray(sel), jnp.asarray(km), 0.1)
    assert float(b) < float(a)


def test_mlm_loss_matches_naive_loop():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32) * 3
    targets = rng.integers(0, 11, (2, 5))
    targets[0, 0] = int(np.argmax(logits[0, 0]))  # at least one hit
    weights = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.float32)
    loss, acc = mlm_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    nll, hit = [], []
    for b in range(2):
        for p in range(5):
            if weights[b, p]:
                z = logits[b, p].astype(np.float64)
                nll.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[targets[b, p]])
                hit.append(np.argmax(z) == targets[b, p])
    np.testing.assert_allclose(float(loss), np.mean(nll), rtol=1e-5)
    np.testing.assert_allclose(float(acc), np.mean(hit), atol=1e-7)


def test_every_position_as_anchor_matches_naive_loop():
    """``tacl.anchors='all'``: objective_sums with an ``anchor_mask`` takes every position it marks
    as an anchor (not only the selected slots); the mean equals the per-anchor loop over them."""
    from tacl_jax.objectives import objective_sums
    from tacl_jax.objectives.masking import Masked

    rng = np.random.default_rng(5)
    b, length, h, p = 2, 8, 6, 3
    ht = rng.normal(size=(b, length, h)).astype(np.float32)
    hs = (ht + rng.normal(size=(b, length, h))).astype(np.float32)
    real = np.ones((b, length), np.int32)
    real[1, 5:] = 0
    positions = np.array([[1, 2, 3], [1, 2, 0]], np.int32)
    weights = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    masked = Masked(input_ids=jnp.zeros((b, length), jnp.int32), selected=jnp.zeros((b, length), bool),
                    positions=jnp.asarray(positions), targets=jnp.zeros((b, p), jnp.int32),
                    weights=jnp.asarray(weights))
    sums = objective_sums(mlm_logits=None, masked=masked, student_hidden=jnp.asarray(hs),
                          teacher_hidden=jnp.asarray(ht), key_mask=jnp.asarray(real), temperature=0.05,
                          anchor_mask=jnp.asarray(real))
    ref_loss, ref_acc = _naive_tacl(hs, ht, real.astype(bool), real, 0.05)
    assert float(sums["n_anchor"]) == real.sum()
    np.testing.assert_allclose(float(sums["tacl_nll"] / sums["n_anchor"]), ref_loss, rtol=2e-4)
    np.testing.assert_allclose(float(sums["tacl_correct"] / sums["n_anchor"]), ref_acc, atol=1e-6)


def test_every_position_as_anchor_turns_off_the_gathered_last_layer():
    from tacl_jax.config import default_config
    from tacl_jax.train.step import step_config_from

    c = default_config()
    special = dict(pad=0, cls=101, sep=102, mask=103, unk=100)
    assert step_config_from(c, special).gather_last_layer
    c.tacl.anchors = "all"
    sc = step_config_from(c, special)
    assert sc.anchors == "all" and not sc.gather_last_layer
