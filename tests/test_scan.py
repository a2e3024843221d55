"""``model.scan_layers``: one ``nn.scan`` over the layers computes exactly what the unrolled encoder
computes given the same (restacked) weights: forward, train loss and gradients under every remat
policy, the Hugging Face round trip, and a checkpointed run of the real loop."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tacl_jax import hf, parallel
from tacl_jax.models import BertConfig, BertModel, stack_layers, unstack_layers
from tacl_jax.train import loop
from tacl_jax.train import setup as setup_lib
from tacl_jax.train import step as step_lib
from tacl_jax.train.step import make_loss_and_grads

from test_checkpoint import _rows
from test_train import _assert_trees_close, _batch, _setup, tiny_config

TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, type_vocab_size=2)


def _inputs(batch=3, length=16, vocab=100, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    mask[1, 10:] = 0
    ids[1, 10:] = 0
    types = np.zeros_like(ids)
    types[:, 7:] = 1
    return ids, mask, types


def _unrolled_params(cfg, seed=3):
    """Unrolled init with non-trivial LayerNorm/bias values, so a swapped or mis-stacked leaf shows."""
    model = BertModel(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"])
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 * jax.random.normal(jax.random.key(len(jax.tree_util.keystr(p))), x.shape)
        if p[-1].key in ("bias", "scale", "mlm_bias") else x, params)
    return model, jax.tree.map(np.asarray, params)


def _apply(model, params, ids, mask, types):
    return model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types),
                       deterministic=True, output_hidden_states=True)


# ----------------------------------------------------------------------------- the model

def test_scanned_forward_equals_unrolled_and_params_are_stacked():
    cfg = BertConfig(**TINY, dtype="float32", with_nsp_head=True)
    model, params = _unrolled_params(cfg)
    scan_model = BertModel(cfg.replace(scan_layers=True))
    stacked = stack_layers(params)
    # The layout: encoder/layers/... with a leading layer axis, equal to the scanned model's init.
    assert list(stacked["encoder"]) == ["layers"]
    boxed = scan_model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    assert jax.tree.map(np.shape, nn.meta.unbox(boxed)) == jax.tree.map(np.shape, stacked)
    np.testing.assert_array_equal(stacked["encoder"]["layers"]["intermediate"]["kernel"][2],
                                  params["encoder"]["layer_2"]["intermediate"]["kernel"])
    back = unstack_layers(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(x, y)
    # Logical names survive the scan: the stacked axis is 'layers' and is never sharded.
    specs = nn.get_partition_spec(boxed)
    assert specs["encoder"]["layers"]["attention"]["query"]["kernel"] == P("layers", "embed", "heads", "kv")
    assert specs["encoder"]["layers"]["output_norm"]["scale"] == P("layers", "embed")
    mesh = parallel.make_mesh(dict(data=2, fsdp=2, tensor=2))
    sh = parallel.logical_shardings(boxed, mesh, parallel.LOGICAL_AXIS_RULES)
    assert sh["encoder"]["layers"]["attention"]["query"]["kernel"].spec == P(None, "fsdp", "tensor", None)
    assert sh["encoder"]["layers"]["intermediate"]["kernel"].spec == P(None, "fsdp", "tensor")

    ids, mask, types = _inputs()
    ref = _apply(model, params, ids, mask, types)
    out = _apply(scan_model, stacked, ids, mask, types)
    assert len(out.hidden_states) == len(ref.hidden_states) == TINY["num_hidden_layers"] + 1
    for i, (a, b) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=f"hidden state {i}")
    # Each layer really is different (a scan that repeated one layer's weights would fail above,
    # but check the states are not trivially equal either).
    assert np.abs(np.asarray(ref.hidden_states[2]) - np.asarray(ref.hidden_states[3])).max() > 1e-2
    for name in ("last_hidden_state", "mlm_logits", "pooled", "nsp_logits"):
        np.testing.assert_allclose(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)), atol=1e-5,
                                   rtol=0, err_msg=name)
    no_states = scan_model.apply({"params": stacked}, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    assert no_states.hidden_states is None
    np.testing.assert_allclose(np.asarray(no_states.mlm_logits), np.asarray(ref.mlm_logits), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="scan_layers must be a bool"):
        BertConfig(**TINY, scan_layers="yes")


@pytest.mark.slow
@pytest.mark.parametrize("policy,want", [("none", None), ("full", "policy=None"),
                                         ("save_dots", "policy=DotsSaveable(only_if_no_batch_dims=True)")])
def test_remat_policy_wraps_the_scanned_layer_body(policy, want):
    """The remat policy is applied inside the scan (one rematerialised layer body), with its
    policy; read off the gradient's jaxpr, nothing is compiled."""
    model = BertModel(BertConfig(**TINY, dtype="float32", scan_layers=True, remat_policy=policy))
    ids = jnp.ones((2, 8), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.key(0), ids)["params"])
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: model.apply({"params": p}, ids).mlm_logits.sum()))(params)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 2                               # the forward and the backward scan
    assert all(e.params["length"] == TINY["num_hidden_layers"] for e in scans)
    body = " ".join(str(e.params["jaxpr"]) for e in scans)
    rest = str(jaxpr).count("remat2[") - body.count("remat2[")
    assert rest == 0                                     # no remat outside the layer body
    if want is None:
        assert "remat2[" not in body
    else:
        assert "remat2[" in body and want in body


def _scan_config(scan: bool, policy: str):
    c = tiny_config(global_batch_size=8, max_len=16)
    c.init.scratch.update(**{k: v for k, v in TINY.items() if k != "type_vocab_size"})
    c.model.hidden_dropout_prob = 0.0       # the scan splits dropout keys per layer differently
    c.model.attention_probs_dropout_prob = 0.0
    c.model.remat_policy = policy
    c.model.scan_layers = scan
    return c


# 'save_dots' is left to test_remat_policy_wraps_the_scanned_layer_body (which policy wraps the
# scanned body) and test_train's remat equality (what each policy computes): ~1 min of CI less.
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "full"])
def test_train_loss_and_grads_equal_unrolled(policy):
    mesh = dict(data=2, fsdp=2, tensor=2)     # the stacked params sharded over fsdp and tensor
    ref = _setup(_scan_config(False, policy), mesh, jax.devices())
    s = _setup(_scan_config(True, policy), mesh, jax.devices())
    # Both with the last layer at the predicted positions (the scanned one: a scan over N-1 layers).
    assert ref["step_cfg"].gather_last_layer and s["step_cfg"].gather_last_layer
    # The scanned state and teacher get the unrolled run's weights, restacked.
    stacked = stack_layers(jax.device_get(ref["state"].params))
    with jax.set_mesh(s["mesh"]):
        params = parallel.place(stacked, s["state_sh"].params)
    s["state"] = s["state"].replace(params=params)
    s["teacher"], _ = setup_lib.create_teacher(params, s["state_sh"].params, "float32")
    batch = _batch(_scan_config(False, policy), 2, ref["model"], ref["special"])

    results = []
    for setup in (ref, s):
        fn = make_loss_and_grads(setup["model"], setup["step_cfg"], step_lib.teacher_of(setup["model"]))
        with jax.set_mesh(setup["mesh"]), nn.logical_axis_rules(setup["rules"]):
            b = {k: jax.device_put(v, parallel.batch_sharding(setup["mesh"], v.ndim)) for k, v in batch.items()}
            results.append(jax.device_get(jax.jit(fn)(setup["state"].params, setup["teacher"], b,
                                                      jax.random.key(7))))
    (l_ref, s_ref, g_ref), (l_scan, s_scan, g_scan) = results
    assert "layers" in g_scan["encoder"] and g_scan["encoder"]["layers"]["output"]["kernel"].shape[0] == 3
    np.testing.assert_allclose(l_scan, l_ref, rtol=1e-5)
    for k in s_ref:
        np.testing.assert_allclose(s_scan[k], s_ref[k], rtol=1e-5, atol=1e-5, err_msg=k)
    assert s_ref["tacl_nll"] > 0 and s_ref["n_pred"] > 0
    g_back = unstack_layers(g_scan)
    assert jax.tree.structure(g_back) == jax.tree.structure(g_ref)
    _assert_trees_close(g_back, g_ref, rtol=1e-4, atol=1e-6)
    assert np.abs(g_ref["encoder"]["layer_0"]["attention"]["query"]["kernel"]).max() > 0


# ----------------------------------------------------------------------------- Hugging Face

@pytest.mark.slow
def test_hf_export_and_load_with_scanned_layers(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    cfg = BertConfig(**TINY, dtype="float32")
    model, params = _unrolled_params(cfg, seed=5)
    scan_model = BertModel(cfg.replace(scan_layers=True))
    stacked = stack_layers(params)
    ids, mask, types = _inputs(seed=1)
    valid = mask.astype(bool)

    # Export from the scanned tree: transformers loads it with no missing keys and the same logits.
    hf.save(scan_model, stacked, str(tmp_path / "scan"), head="mlm")
    pt, info = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "scan"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        theirs = pt.eval()(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                           token_type_ids=torch.tensor(types, dtype=torch.long)).logits.numpy()
    ours = np.asarray(_apply(scan_model, stacked, ids, mask, types).mlm_logits)
    np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=1e-4)
    # The same files as an export of the unrolled tree.
    hf.save(model, params, str(tmp_path / "plain"), head="mlm")
    a, b = hf.read_state_dict(str(tmp_path / "scan")), hf.read_state_dict(str(tmp_path / "plain"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # A tree in the other layout than the model's is refused with a clear error.
    with pytest.raises(ValueError, match="scan_layers=False"):
        hf.save(model, stacked, str(tmp_path / "bad"))

    # Load a transformers-written folder into both layouts: same params (restacked), same outputs,
    # both equal to transformers' logits.
    torch.manual_seed(0)
    pt2 = transformers.BertForMaskedLM(transformers.BertConfig(**TINY, hidden_act="gelu")).eval()
    pt2.save_pretrained(tmp_path / "torch")
    m_plain, p_plain = hf.load(str(tmp_path / "torch"), dtype="float32")
    m_scan, p_scan = hf.load(str(tmp_path / "torch"), dtype="float32", scan_layers=True)
    assert m_scan.config.scan_layers and not m_plain.config.scan_layers
    assert list(p_scan["encoder"]) == ["layers"]
    restacked = stack_layers(p_plain)
    assert jax.tree.structure(p_scan) == jax.tree.structure(restacked)
    for x, y in zip(jax.tree.leaves(p_scan), jax.tree.leaves(restacked)):
        np.testing.assert_array_equal(x, y)
    o_plain, o_scan = _apply(m_plain, p_plain, ids, mask, types), _apply(m_scan, p_scan, ids, mask, types)
    for x, y in zip(o_scan.hidden_states, o_plain.hidden_states):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(o_scan.mlm_logits), np.asarray(o_plain.mlm_logits), atol=1e-5, rtol=0)
    with torch.no_grad():
        theirs2 = pt2(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                      token_type_ids=torch.tensor(types, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(o_scan.mlm_logits)[valid], theirs2[valid], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- the loop



@pytest.mark.slow
def test_loop_with_scan_checkpoints_resumes_and_matches_unrolled_run(tmp_path):
    """Both runs start from the same HF folder (student and teacher), dropout off: the scanned run,
    paused after 2 steps and resumed from its checkpoint on a sharded mesh, follows the unrolled
    run step for step, and its export and its converted checkpoint are the unrolled run's."""
    from tacl_jax.convert import export_checkpoint
    from tacl_jax.data import testing

    tok = testing.write_toy_tokenizer(str(tmp_path / "tok"))
    cfg = BertConfig(**dict(TINY, vocab_size=128), dtype="float32")
    model, params = _unrolled_params(cfg, seed=9)
    init_dir = hf.save(model, params, str(tmp_path / "init"), head="mlm", tokenizer_from=tok)

    def config(scan):
        c = _scan_config(scan, "none")
        c.init.from_scratch = False
        c.init.hf_path = init_dir
        c.update_from_flattened_dict({"num_train_steps": 4, "log_every": 1, "eval_at_end": False,
                                      "checkpoint.every": 2, "checkpoint.async_save": False})
        if scan:
            c.mesh.update(data=2, fsdp=2, tensor=2)
            c.steps_per_run = 2
        return c

    ref = loop.train_and_evaluate(config(False), str(tmp_path / "ref"))
    first = loop.train_and_evaluate(config(True), str(tmp_path / "scan"))
    assert first["status"] == "paused" and int(first["state"].step) == 2
    assert first["state"].params["encoder"]["layers"]["attention"]["key"]["kernel"].shape == (3, 32, 2, 16)
    res = loop.train_and_evaluate(config(True), str(tmp_path / "scan"))
    assert ref["status"] == res["status"] == "finished" and int(res["state"].step) == 4

    a, b = _rows(tmp_path / "ref"), _rows(tmp_path / "scan")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        for k in ("loss", "mlm_loss", "tacl_loss", "grad_norm"):
            np.testing.assert_allclose(b[step][k], a[step][k], rtol=1e-4, err_msg=f"step {step} {k}")
    assert a[4]["loss"] != a[1]["loss"]      # the runs moved
    _assert_trees_close(unstack_layers(jax.device_get(res["state"].params)), jax.device_get(ref["state"].params),
                        rtol=1e-4, atol=1e-5)

    # The final export (unstacked on save) and a conversion of the scanned checkpoint.
    exp_ref = hf.read_state_dict(str(tmp_path / "ref" / "export" / "final"))
    exp_scan = hf.read_state_dict(str(tmp_path / "scan" / "export" / "final"))
    export_checkpoint(str(tmp_path / "scan"), str(tmp_path / "converted"))
    conv = hf.read_state_dict(str(tmp_path / "converted"))
    assert sorted(exp_ref) == sorted(exp_scan) == sorted(conv)
    for k in exp_ref:
        np.testing.assert_allclose(exp_scan[k], exp_ref[k], rtol=1e-4, atol=1e-5, err_msg=k)
        np.testing.assert_array_equal(conv[k], exp_scan[k], err_msg=k)
