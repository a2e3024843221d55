"""Our BERT against PyTorch ``transformers`` with identical weights, and the HF round trip."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # in the test extras; never skipped in CI
import transformers  # noqa: E402

from tacl_jax import hf  # noqa: E402
from tacl_jax.models import BertConfig, BertModel  # noqa: E402

TINY = dict(vocab_size=203, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=40, type_vocab_size=2)


def _inputs(batch=3, length=17, vocab=203, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (batch, length)).astype(np.int64)
    mask = np.ones((batch, length), np.int64)
    mask[1, 11:] = 0  # a padded row: attention masks must work
    ids[1, 11:] = 0
    types = np.zeros_like(ids)
    types[:, 8:] = 1
    return ids, mask, types


def _torch_model(cls, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(**TINY, hidden_act="gelu")
    m = cls(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorm and bias values, so a swapped tensor shows
        for name, p in m.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return m


def _ours(model, params, ids, mask, types, **kw):
    return model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types),
                       deterministic=True, output_hidden_states=True, **kw)


def test_forward_matches_transformers_bert_for_pretraining(tmp_path):
    pt = _torch_model(transformers.BertForPreTraining)
    pt.save_pretrained(tmp_path)
    model, params = hf.load(str(tmp_path), dtype="float32", with_nsp_head=True)
    ids, mask, types = _inputs()
    with torch.no_grad():
        ref = pt(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types),
                 output_hidden_states=True)
    out = _ours(model, params, ids, mask, types)
    valid = mask.astype(bool)  # padded positions' states are arbitrary in both
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):
        np.testing.assert_allclose(np.asarray(ours)[valid], theirs.numpy()[valid], atol=1e-4, rtol=1e-4)
    assert out.mlm_logits.shape == (3, 17, TINY["vocab_size"])  # padded vocab rows never returned
    np.testing.assert_allclose(np.asarray(out.mlm_logits)[valid], ref.prediction_logits.numpy()[valid],
                               atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(out.nsp_logits), ref.seq_relationship_logits.numpy(), atol=1e-4)


def test_gathered_mlm_head_equals_full_head(tmp_path):
    pt = _torch_model(transformers.BertForMaskedLM)
    pt.save_pretrained(tmp_path)
    model, params = hf.load(str(tmp_path), dtype="float32")
    ids, mask, types = _inputs()
    positions = np.array([[1, 4, 9], [2, 3, 10], [0, 16, 5]])
    full = _ours(model, params, ids, mask, types).mlm_logits
    gathered = _ours(model, params, ids, mask, types, mlm_positions=jnp.asarray(positions)).mlm_logits
    np.testing.assert_allclose(np.asarray(gathered), np.take_along_axis(np.asarray(full), positions[..., None], 1),
                               atol=1e-5)


@pytest.mark.parametrize("head,cls", [("mlm", transformers.BertForMaskedLM), ("none", transformers.BertModel)])
def test_export_loads_in_transformers_with_same_outputs(tmp_path, head, cls):
    cfg = BertConfig(**TINY, dtype="float32")
    model = BertModel(cfg)
    ids, mask, types = _inputs()
    import flax.linen as nn
    params = nn.meta.unbox(model.init(jax.random.key(3), jnp.asarray(ids))["params"])
    # Random non-trivial LayerNorm/bias values, so a mix-up of scale and bias shows.
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
        if p[-1].key in ("bias", "scale", "mlm_bias") else x, params)
    hf.save(model, params, str(tmp_path), head=head)
    pt, info = cls.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = _ours(model, params, ids, mask, types)
    with torch.no_grad():
        ref = pt.eval()(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types))
    valid = mask.astype(bool)
    if head == "mlm":
        np.testing.assert_allclose(np.asarray(ours.mlm_logits)[valid], ref.logits.numpy()[valid], atol=1e-4, rtol=1e-4)
    else:
        np.testing.assert_allclose(np.asarray(ours.last_hidden_state)[valid],
                                   ref.last_hidden_state.numpy()[valid], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(ours.pooled), ref.pooler_output.numpy(), atol=1e-4)
    # Round trip: reading our export back gives the same parameters.
    _, back = hf.load(str(tmp_path), dtype="float32")
    for path, leaf in jax.tree_util.tree_leaves_with_path(back):
        if path[0].key in ({"pooler"} if head == "mlm" else {"mlm_transform", "mlm_norm", "mlm_bias"}):
            continue  # a head the format has no place for: not exported, re-initialised on load
        orig = params
        for k in path:
            orig = orig[k.key]
        v = TINY["vocab_size"]  # vocabulary padding rows are not exported
        np.testing.assert_allclose(leaf[:v], np.asarray(orig)[:v], atol=1e-6, err_msg=str(path))


def test_encoder_only_checkpoint_initialises_mlm_head(tmp_path, caplog):
    pt = _torch_model(transformers.BertModel)
    pt.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="tacl_jax.hf"):
        model, params = hf.load(str(tmp_path), dtype="float32")
    assert "no mlm head" in caplog.text
    assert params["mlm_bias"].shape == (model.config.padded_vocab_size,)
    ids, mask, types = _inputs()
    with torch.no_grad():
        ref = pt(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types))
    out = _ours(model, params, ids, mask, types)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out.last_hidden_state)[valid], ref.last_hidden_state.numpy()[valid],
                               atol=1e-4, rtol=1e-4)


def test_real_minilm_checkpoint_matches_transformers(minilm_dir):
    """The real pretrained MiniLM (encoder-only, sentence-transformers layout) read both ways."""
    model, params = hf.load(minilm_dir, dtype="float32")
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    enc = tok(["the cat sat on the mat.", "contrastive learning of token representations"],
              padding=True, return_tensors="np")
    pt = transformers.BertModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        ref = pt(**{k: torch.tensor(v) for k, v in enc.items()}).last_hidden_state.numpy()
    out = _ours(model, params, enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    valid = enc["attention_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(out.last_hidden_state)[valid], ref[valid], atol=1e-4, rtol=1e-4)


def test_bad_folders_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.load(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="folder .*nope' does not exist") as e:
        hf.read_config(str(tmp_path / "nope"))        # what the loop reads first: not "config.json not found"
    assert "config.json not found" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": 32, "num_attention_heads": 4}')
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf.load(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type"):
        hf.load(str(tmp_path))


def test_real_minilm_export_round_trip_through_transformers(minilm_dir, tmp_path):
    """The real checkpoint exported both ways: BertForMaskedLM logits (with the MLM head we
    initialised) and BertModel hidden states equal ours."""
    model, params = hf.load(minilm_dir, dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    enc = tok(["a token-aware contrastive objective."], return_tensors="np")
    ours = _ours(model, params, enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    feed = {k: torch.tensor(v) for k, v in enc.items()}
    hf.save(model, params, str(tmp_path / "mlm"), head="mlm", tokenizer_from=minilm_dir)
    pt, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "mlm", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        logits = pt.eval()(**feed).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours.mlm_logits), logits, atol=1e-4, rtol=1e-4)
    hf.save(model, params, str(tmp_path / "enc"), head="none")
    pt, info = transformers.AutoModel.from_pretrained(tmp_path / "enc", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        hidden = pt.eval()(**feed).last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(ours.last_hidden_state), hidden, atol=1e-4, rtol=1e-4)
