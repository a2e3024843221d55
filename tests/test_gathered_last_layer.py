"""The student's last layer computed only at the predicted positions (``model.gather_last_layer``,
the default for TaCL/MLM): the model's outputs there, the step's loss and gradients, and the FLOPs
formula against the full last layer and against the compiled step's own matmuls."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from tacl_jax.flops import step_flops
from tacl_jax.models import BertConfig, BertModel
from tacl_jax.models.bert import Layer, attention_bias
from tacl_jax.train import step as step_lib
from tacl_jax.train.step import make_loss_and_grads
import hlo_text
from test_train import _assert_trees_close, _batch, _grads, _setup, tiny_config

SINGLE = dict(data=1, fsdp=1, tensor=1)


def _model_and_inputs(**overrides):
    cfg = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=32, dtype="float32", **overrides)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 96, size=(3, 16)).astype(np.int32)
    mask = np.ones((3, 16), np.int32)
    mask[1, 11:] = 0
    types = np.zeros((3, 16), np.int32)
    types[:, 8:] = 1
    positions = np.array([[1, 4, 9, 0], [2, 3, 10, 0], [15, 5, 7, 12]], np.int32)  # unsorted, repeats
    model = BertModel(cfg)
    params = model.init(jax.random.key(0), ids, mask, types)["params"]
    return model, nn.meta.unbox(params), (ids, mask, types), positions


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(), dict(with_nsp_head=True), dict(remat_policy="full"),
                                       dict(scan_layers=True), dict(scan_layers=True, remat_policy="full")],
                         ids=["plain", "nsp", "remat", "scan", "scan_remat"])
def test_model_outputs_at_positions_equal_the_full_model(overrides):
    model, params, args, positions = _model_and_inputs(**overrides)
    full = model.apply({"params": params}, *args, output_hidden_states=True, mlm_positions=positions)
    part = model.apply({"params": params}, *args, output_hidden_states=True, last_layer_positions=positions)
    at = np.take_along_axis(np.asarray(full.last_hidden_state), positions[..., None], axis=1)
    assert part.last_hidden_state.shape == (3, 4, 32)
    np.testing.assert_allclose(np.asarray(part.last_hidden_state), at, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(part.mlm_logits), np.asarray(full.mlm_logits), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(part.hidden_states[-1]), at, rtol=1e-5, atol=1e-5)
    for a, b in zip(part.hidden_states[:-1], full.hidden_states[:-1]):  # the layers below: unchanged
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if model.config.with_nsp_head:   # [CLS] through the model's extra slot
        np.testing.assert_allclose(np.asarray(part.pooled), np.asarray(full.pooled), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(part.nsp_logits), np.asarray(full.nsp_logits), rtol=1e-5, atol=1e-5)
    else:
        assert part.pooled is None, "the pooler reads [CLS], which is not among the positions"


@pytest.mark.slow
def test_model_refuses_positions_it_cannot_honour():
    model, params, args, positions = _model_and_inputs()
    with pytest.raises(ValueError, match="either mlm_positions or last_layer_positions"):
        model.apply({"params": params}, *args, mlm_positions=positions, last_layer_positions=positions)


@pytest.mark.slow
def test_scanned_encoder_with_gathered_last_layer_drops_out_in_every_layer():
    """The scanned encoder's gathered path (a scan over the first N-1 slices of the stacked params,
    then the last layer alone) applies dropout in every layer with the dropout stream: each layer's
    output differs from that layer run deterministically on the same input, the draws repeat with
    the key and change with it; and the stacked params (made by the full scan) get every gradient."""
    model, params, (ids, mask, types), positions = _model_and_inputs(scan_layers=True, hidden_dropout_prob=0.2,
                                                                     attention_probs_dropout_prob=0.2)
    n = model.config.num_hidden_layers

    @jax.jit
    def run(key):
        return model.apply({"params": params}, ids, mask, types, deterministic=False, output_hidden_states=True,
                           last_layer_positions=positions, rngs={"dropout": jax.random.key(key)})

    out, again, other = run(1), run(1), run(2)
    np.testing.assert_array_equal(np.asarray(out.mlm_logits), np.asarray(again.mlm_logits))
    assert np.abs(np.asarray(out.mlm_logits) - np.asarray(other.mlm_logits)).max() > 1e-3
    bias = attention_bias(mask)
    stacked = params["encoder"]["layers"]
    for i in range(n):
        pos = positions if i == n - 1 else None
        plain = jax.jit(Layer(model.config).apply, static_argnums=3)(
            {"params": jax.tree.map(lambda a: a[i], stacked)}, out.hidden_states[i], bias, True, pos)
        assert plain.shape == out.hidden_states[i + 1].shape
        assert np.abs(np.asarray(plain) - np.asarray(out.hidden_states[i + 1])).max() > 1e-3, f"layer {i}"

    def loss(p):
        o = model.apply({"params": p}, ids, mask, types, deterministic=False, last_layer_positions=positions,
                        rngs={"dropout": jax.random.key(1)})
        return (o.mlm_logits ** 2).mean()

    grads = jax.jit(jax.grad(loss))(params)["encoder"]["layers"]
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert g.shape[0] == n and all(np.abs(np.asarray(g[i])).max() > 0 for i in range(n)), path


@pytest.mark.slow
@pytest.mark.parametrize("nsp,scan", [(False, False), (True, False), (False, True)], ids=["plain", "nsp", "scan"])
def test_step_loss_and_grads_equal_the_full_last_layer(nsp, scan):
    """Same loss terms, same gradients; without dropout, whose masks are drawn for other shapes."""
    results = {}
    for gather in (True, False):
        config = tiny_config(nsp=nsp)
        config.model.scan_layers = scan
        config.model.gather_last_layer = gather
        config.model.hidden_dropout_prob = config.model.attention_probs_dropout_prob = 0.0
        s = _setup(config, SINGLE, jax.devices()[:1])
        assert s["step_cfg"].gather_last_layer is gather
        results[gather] = _grads(s, _batch(config, 0, s["model"], s["special"]))
    (l1, s1, g1), (l0, s0, g0) = results[True], results[False]
    assert set(s1) == set(s0) and ("nsp_nll" in s1) is nsp
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for k in s0:
        np.testing.assert_allclose(s1[k], s0[k], rtol=1e-5, atol=1e-5, err_msg=k)
    _assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6, leaf_atol=1e-4)


def _dot_flops(hlo: str) -> float:
    """Σ 2·|out|·|contracted| over the dots of compiled HLO text, leaving out the ``ones · g``
    bias-gradient products (an operand with a unit dimension), which the formula ignores."""
    return float(sum(d.flops for d in hlo_text.dots(hlo)
                     if 1 not in d.lhs_shape + d.rhs_shape + d.out_shape))


@pytest.mark.slow
@pytest.mark.parametrize("gather", [True, False])
def test_step_flops_formula_matches_the_compiled_step(gather):
    """``flops.step_flops`` (the MFU's numerator) against the matmuls XLA actually runs in the
    compiled loss-and-gradient step: within 2% (the formula leaves out bias gradients and counts
    the vocabulary unpadded), and the gathered layer's saving is real (~24% of this 2-layer step)."""
    config = tiny_config()
    config.model.gather_last_layer = gather
    s = _setup(config, SINGLE, jax.devices()[:1])
    fn = make_loss_and_grads(s["model"], s["step_cfg"], step_lib.teacher_of(s["model"]))
    batch = _batch(config, 0, s["model"], s["special"])
    with jax.set_mesh(s["mesh"]), nn.logical_axis_rules(s["rules"]):
        hlo = jax.jit(fn).lower(s["state"].params, s["teacher"], batch, jax.random.key(0)).compile().as_text()
    kw = dict(batch=config.global_batch_size, length=config.max_len, predictions=s["step_cfg"].max_predictions,
              teacher=True)
    want = step_flops(s["model"].config, gathered_last_layer=gather, **kw)
    np.testing.assert_allclose(_dot_flops(hlo), want, rtol=0.02)
    if gather:
        assert want < 0.8 * step_flops(s["model"].config, gathered_last_layer=False, **kw)


def test_gathered_flops_with_every_position_predicted_equal_the_full_count():
    cfg = BertConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256)
    full = step_flops(cfg, batch=4, length=32, predictions=32, teacher=True)
    assert step_flops(cfg, batch=4, length=32, predictions=32, teacher=True, gathered_last_layer=True) == full
