"""Our BERT against PyTorch ``transformers`` with identical weights, and the HF round trip."""

import json
import logging
import os
import socket
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # in the test extras; never skipped in CI
import transformers  # noqa: E402

from tacl_jax import hf, precision  # noqa: E402
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


def _torch_model(cls, seed=0, **kw):
    """A tiny transformers model of ``cls`` (``kw``: more BertConfig fields)."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(**{"hidden_act": "gelu", **TINY, **kw})
    m = cls(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorm and bias values, so a swapped tensor shows
        for name, p in m.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return m


def _ours(model, params, ids, mask, types, **kw):
    return model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types),
                       deterministic=True, output_hidden_states=True, **kw)


@pytest.mark.parametrize("dtype", ["float32", None])
def test_forward_matches_transformers_bert_for_pretraining(tmp_path, dtype, monkeypatch):
    """``dtype=None``: hf.load's default, training's 'auto', is f32 on a CPU without bf16 units."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2"}))
    pt = _torch_model(transformers.BertForPreTraining)
    pt.save_pretrained(tmp_path)
    model, params = hf.load(str(tmp_path), with_nsp_head=True, **({"dtype": dtype} if dtype else {}))
    assert model.config.dtype == "float32"
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


def test_load_default_dtype_is_trainings_auto_rule(tmp_path, monkeypatch):
    """hf.load computes in what ``model.dtype='auto'`` gives on this process's devices
    (precision.resolve_compute_dtype); an explicit dtype is kept."""
    pt = _torch_model(transformers.BertForMaskedLM)
    pt.save_pretrained(tmp_path)
    assert jax.devices()[0].platform == "cpu"
    def dtype(**kw):  # no pooler: nothing to initialise, only reading
        return hf.load(str(tmp_path), with_pooler=False, **kw)[0].config.dtype

    assert dtype() == precision.resolve_compute_dtype("auto", "cpu")
    for flags, want in (({"avx2"}, "float32"), ({"avx512_bf16"}, "bfloat16"), ({"amx_bf16"}, "bfloat16")):
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert dtype() == dtype(dtype="auto") == want
        assert (dtype(dtype="bfloat16"), dtype(dtype="float32")) == ("bfloat16", "float32")


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- export folder safety

@pytest.fixture(scope="module")
def tiny():
    """A random tiny ``(BertModel, params)`` with the MLM head and pooler (f32, unrolled)."""
    import flax.linen as nn

    model = BertModel(BertConfig(**TINY, dtype="float32"))
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    return model, jax.tree.map(np.asarray, params)


def _foreign_folder(path):
    """A folder another tool wrote: an old tokenizer and pickle beside a config."""
    path.mkdir()
    (path / "pytorch_model.bin").write_bytes(b"old weights")
    (path / "vocab.txt").write_text("[PAD]\n")
    (path / "config.json").write_text('{"model_type": "bert"}')
    return {p.name: p.read_bytes() for p in path.iterdir()}


def _contents(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_save_refuses_a_non_empty_folder_and_overwrite_replaces_it_whole(tmp_path, tiny):
    model, params = tiny
    out = tmp_path / "out"
    before = _foreign_folder(out)
    for mode in (False, "ours"):  # "ours": no marker, so not ours
        with pytest.raises(hf.ExportDirError, match=f"{out}.*(--overwrite|not a tacl_jax export)") as e:
            hf.save(model, params, str(out), overwrite=mode)
        assert "\n" not in str(e.value)
        assert _contents(out) == before  # refused before writing anything
    hf.save(model, params, str(out), overwrite=True)
    # Replaced whole: nothing of the old model is left beside the new one.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", hf.EXPORT_MARKER]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left
    _, info = transformers.BertForMaskedLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with pytest.raises(ValueError, match="overwrite=1"):
        hf.save(model, params, str(out), overwrite=1)


def test_save_ours_replaces_only_a_folder_tacl_jax_wrote(tmp_path, tiny, minilm_dir):
    model, params = tiny
    empty = tmp_path / "empty"
    empty.mkdir()
    hf.save(model, params, str(empty))  # an empty folder is free without any overwrite
    out = tmp_path / "export"
    hf.save(model, params, str(out), head="mlm", tokenizer_from=minilm_dir, overwrite="ours")
    marker = json.loads((out / hf.EXPORT_MARKER).read_text())
    assert marker["head"] == "mlm" and marker["tacl_jax"] and marker["time"]
    assert "vocab.txt" in marker["files"] and "model.safetensors" in marker["files"]
    with pytest.raises(hf.ExportDirError, match="already exists"):
        hf.save(model, params, str(out))  # the default never replaces, not even our own export
    hf.save(model, params, str(out), head="none", overwrite="ours")  # a rerun redoes its own export
    assert json.loads((out / hf.EXPORT_MARKER).read_text())["head"] == "none"
    assert "vocab.txt" not in _contents(out)  # replaced whole, not merged
    (out / "notes.txt").write_text("mine")  # a user's file in our export: no longer ours alone
    with pytest.raises(hf.ExportDirError, match="notes.txt"):
        hf.save(model, params, str(out), overwrite="ours")
    assert (out / "notes.txt").read_text() == "mine"


def test_save_out_dir_that_is_a_file_or_under_a_file(tmp_path, tiny):
    model, params = tiny
    f = tmp_path / "model.bin"
    f.write_bytes(b"keep me")
    for out, overwrite in ((f, False), (f, True), (f / "sub", True)):
        with pytest.raises(hf.ExportDirError, match=f"{f}.* is a file"):
            hf.save(model, params, str(out), overwrite=overwrite)
    assert f.read_bytes() == b"keep me"
    with pytest.raises(hf.ExportDirError, match="local folders only"):
        hf.check_out_dir("gs://bucket/export")


def test_failed_save_leaves_the_old_export_untouched(tmp_path, tiny, minilm_dir, monkeypatch):
    model, params = tiny
    out = tmp_path / "out"
    hf.save(model, params, str(out), head="none")
    before = _contents(out)

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    # Fails after model.safetensors and config.json of the new export are written.
    monkeypatch.setattr(hf.shutil, "copyfile", disk_full)
    with pytest.raises(OSError, match="No space"):
        hf.save(model, params, str(out), head="mlm", tokenizer_from=minilm_dir, overwrite=True)
    assert _contents(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.slow
def test_save_removes_what_a_killed_save_left(tmp_path, tiny):
    model, params = tiny
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    host = socket.gethostname()
    left = tmp_path / f".out.tmp-{host}-{dead}"  # a save killed while writing
    running = tmp_path / f".out.tmp-{host}-{os.getppid()}"  # a save still going on
    other_host = tmp_path / f".out.tmp-elsewhere-{dead}"
    for d in (left, running, other_host):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    hf.save(model, params, str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", running.name, other_host.name])


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_export_files_honour_the_umask(tmp_path, tiny, minilm_dir, umask):
    model, params = tiny
    old = os.umask(umask)
    try:
        hf.save(model, params, str(tmp_path / "out"), tokenizer_from=minilm_dir)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert modes and set(modes.values()) == {0o666 & ~umask}, {k: oct(v) for k, v in modes.items()}
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


# ----------------------------------------------------------------------------- damaged or inconsistent folders

def test_damaged_files_give_one_line_naming_them(tmp_path, tiny):
    model, params = tiny
    out = tmp_path / "m"
    hf.save(model, params, str(out))
    st = out / "model.safetensors"
    good = st.read_bytes()
    for bad in (good[:len(good) // 2], b"\x00" * 3 + bytes(range(256)), b""):
        st.write_bytes(bad)
        for read in (hf.load, hf.read_state_dict):
            with pytest.raises(hf.FolderError, match=f"{st} is damaged.*re-download") as e:
                read(str(out))
            assert "\n" not in str(e.value)
    st.write_bytes(good)
    cfg = out / "config.json"
    good_cfg = cfg.read_text()
    for bad, what in ((good_cfg[:len(good_cfg) // 2], "is damaged"), ("[1, 2]", "is damaged"),
                      (good_cfg.replace('"hidden_size": 32', '"hidden_size": "32"'), "hidden_size is '32'")):
        cfg.write_text(bad)
        with pytest.raises(ValueError, match=f"{cfg}.*{what}"):
            hf.load(str(out))
    cfg.write_text(good_cfg)
    # Sharded: a damaged index, and a shard it lists that is missing.
    st.rename(out / "model-00001-of-00002.safetensors")
    index = out / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=f"{index} is damaged"):
        hf.read_state_dict(str(out))
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors is missing"):
        hf.read_state_dict(str(out))
    # A truncated PyTorch pickle.
    for p in out.glob("model*"):
        p.unlink()
    torch.save({"x": torch.zeros(3)}, out / "pytorch_model.bin")
    pt = out / "pytorch_model.bin"
    pt.write_bytes(pt.read_bytes()[:40])
    with pytest.raises(ValueError, match=f"{pt} cannot be read.*damaged"):
        hf.read_state_dict(str(out))


def test_vocab_size_mismatch_is_refused_and_padding_stays_internal(tmp_path, tiny):
    model, params = tiny
    out = tmp_path / "m"
    hf.save(model, params, str(out))
    cfg = out / "config.json"
    good = cfg.read_text()
    _, back = hf.load(str(out), dtype="float32", with_pooler=False)  # padding to a multiple of 128: intended, silent
    assert back["embeddings"]["word_embeddings"]["embedding"].shape == (256, 32)
    assert not back["embeddings"]["word_embeddings"]["embedding"][203:].any()
    for v in (250, 150):  # more rows than the checkpoint (were zero-padded), fewer (were dropped)
        cfg.write_text(good.replace('"vocab_size": 203', f'"vocab_size": {v}'))
        with pytest.raises(hf.FolderError, match=f"{out}: embeddings.word_embeddings.weight has 203 rows "
                                             f"but the config's vocab_size is {v}"):
            hf.load(str(out), dtype="float32", with_pooler=False)
    cfg.write_text(good)
    with pytest.raises(ValueError, match="vocab_size=300.*cannot be resized"):
        hf.load(str(out), vocab_size=300)
    hf.load(str(out), vocab_size=203, dtype="float32", with_pooler=False)  # the checkpoint's own size: fine
