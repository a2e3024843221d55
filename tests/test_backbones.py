"""RoBERTa and ELECTRA checkpoints in and out (``hf.load`` / ``hf.save``) against PyTorch
``transformers`` with identical weights, RoBERTa's special tokens in the data path, and a train
step from a RoBERTa folder. Tiny random models built here (no download)."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # in the test extras; never skipped in CI
import transformers  # noqa: E402

from tacl_jax import hf  # noqa: E402
from tacl_jax.models import BertConfig, BertModel  # noqa: E402

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_act="gelu")
ROBERTA = dict(TINY, max_position_embeddings=40, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
               eos_token_id=2, layer_norm_eps=1e-5)
ELECTRA = dict(TINY, max_position_embeddings=40, type_vocab_size=2, embedding_size=16, pad_token_id=0)
TOL = dict(atol=1e-5, rtol=1e-5)


def _perturbed(m):
    """``m`` in eval mode with non-trivial LayerNorm and bias values, so a swapped tensor shows."""
    m.eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return m


def _roberta(cls, seed=0, **kw):
    torch.manual_seed(seed)
    return _perturbed(cls(transformers.RobertaConfig(**ROBERTA, **kw)))


def _electra(cls, seed=0, **kw):
    torch.manual_seed(seed)
    return _perturbed(cls(transformers.ElectraConfig(**{**ELECTRA, **kw})))


def _inputs(pad_id, batch=3, length=17, vocab=99, seed=0, types=False):
    """Ids ``[B, L]`` with a right-padded row and a row with a pad in the middle (RoBERTa's
    position ids skip every pad, wherever it is)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (batch, length)).astype(np.int64)
    mask = np.ones((batch, length), np.int64)
    mask[1, 11:] = 0
    ids[1, 11:] = pad_id
    ids[2, 5] = pad_id               # attended, but a pad: position pad_id in RoBERTa
    tt = np.zeros_like(ids)
    if types:
        tt[:, 8:] = 1
    return ids, mask, tt


def _ours(model, params, ids, mask, tt, **kw):
    return model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(tt),
                       deterministic=True, output_hidden_states=True, **kw)


def _theirs(pt, ids, mask, tt):
    with torch.no_grad():
        return pt(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(tt),
                  output_hidden_states=True)


def _reload(cls, folder):
    """transformers' model of ``folder``, asserting no missing or unexpected keys."""
    m, info = cls.from_pretrained(folder, output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(k), (k, info[k])
    return m.eval()


# ----------------------------------------------------------------------------- RoBERTa

@pytest.mark.parametrize("scan", [False, True])
def test_roberta_load_matches_transformers_and_round_trips(tmp_path, scan):
    pt = _roberta(transformers.RobertaForMaskedLM)
    pt.save_pretrained(tmp_path / "in")
    model, params = hf.load(str(tmp_path / "in"), dtype="float32", kernels="xla", scan_layers=scan)
    cfg = model.config
    assert (cfg.model_type, cfg.pad_token_id, cfg.type_vocab_size, cfg.layer_norm_eps) == ("roberta", 1, 1, 1e-5)
    assert cfg.max_length == 40 - 2 and "embeddings_project" not in params["embeddings"]
    ids, mask, tt = _inputs(pad_id=1)
    ref = _theirs(pt, ids, mask, tt)
    out = _ours(model, params, ids, mask, tt)
    valid = mask.astype(bool)  # padded positions' states are arbitrary in both
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):
        np.testing.assert_allclose(np.asarray(ours)[valid], theirs.numpy()[valid], **TOL)
    np.testing.assert_allclose(np.asarray(out.mlm_logits)[valid], ref.logits.numpy()[valid], **TOL)

    hf.save(model, params, str(tmp_path / "mlm"), head="mlm")
    cfg_json = json.loads((tmp_path / "mlm" / "config.json").read_text())
    assert cfg_json["model_type"] == "roberta" and cfg_json["architectures"] == ["RobertaForMaskedLM"]
    back = _reload(transformers.RobertaForMaskedLM, tmp_path / "mlm")
    np.testing.assert_allclose(_theirs(back, ids, mask, tt).logits.numpy()[valid], ref.logits.numpy()[valid], **TOL)

    hf.save(model, params, str(tmp_path / "base"), head="none")   # pooler initialised by hf.load
    base = _reload(transformers.RobertaModel, tmp_path / "base")
    got = _theirs(base, ids, mask, tt)
    np.testing.assert_allclose(got.last_hidden_state.numpy()[valid], ref.hidden_states[-1].numpy()[valid], **TOL)
    np.testing.assert_allclose(got.pooler_output.numpy(), np.asarray(out.pooled), **TOL)


def test_roberta_encoder_only_folder_and_position_ids(tmp_path):
    """A RobertaModel folder (no prefix, pooler, no head); position ids are transformers'."""
    from tacl_jax.models.bert import position_ids

    pt = _roberta(transformers.RobertaModel, seed=1)
    pt.save_pretrained(tmp_path)
    model, params = hf.load(str(tmp_path), dtype="float32", kernels="xla", with_mlm_head=False)
    ids, mask, tt = _inputs(pad_id=1, seed=1)
    ref = _theirs(pt, ids, mask, tt)
    out = _ours(model, params, ids, mask, tt)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out.last_hidden_state)[valid], ref.last_hidden_state.numpy()[valid], **TOL)
    np.testing.assert_allclose(np.asarray(out.pooled), ref.pooler_output.numpy(), **TOL)
    theirs = transformers.models.roberta.modeling_roberta.RobertaEmbeddings.create_position_ids_from_input_ids(
        torch.tensor(ids), 1)
    np.testing.assert_array_equal(np.asarray(position_ids(jnp.asarray(ids), model.config)), theirs.numpy())


def test_roberta_too_long_input_names_the_offset():
    cfg = BertConfig(**{k: v for k, v in ROBERTA.items() if k in ("vocab_size", "hidden_size",
                     "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings",
                     "type_vocab_size", "pad_token_id")}, model_type="roberta", dtype="float32")
    model = BertModel(cfg)
    with pytest.raises(ValueError, match="pad_token_id"):
        model.init(jax.random.key(0), jnp.ones((1, 39), jnp.int32))


# ----------------------------------------------------------------------------- ELECTRA

def test_electra_discriminator_load_matches_and_exports(tmp_path, caplog):
    """ElectraForPreTraining (embedding_size 16 != hidden 32): the encoder matches, the MLM head is
    initialised (and said so); the export loads as ElectraForMaskedLM / ElectraModel and equals us."""
    pt = _electra(transformers.ElectraForPreTraining)
    pt.save_pretrained(tmp_path / "in")
    with caplog.at_level(logging.INFO, logger="tacl_jax.hf"):
        model, params = hf.load(str(tmp_path / "in"), dtype="float32", kernels="xla")
    assert "ELECTRA discriminator has no MLM head" in caplog.text
    cfg = model.config
    assert (cfg.model_type, cfg.embedding_size, cfg.embed_size) == ("electra", 16, 16)
    assert params["embeddings"]["embeddings_project"]["kernel"].shape == (16, 32)
    assert params["embeddings"]["word_embeddings"]["embedding"].shape == (cfg.padded_vocab_size, 16)
    assert params["mlm_transform"]["kernel"].shape == (32, 16)
    ids, mask, tt = _inputs(pad_id=0, types=True)
    ref = _theirs(pt, ids, mask, tt)
    out = _ours(model, params, ids, mask, tt)
    valid = mask.astype(bool)
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):   # [0]: after embeddings_project
        np.testing.assert_allclose(np.asarray(ours)[valid], theirs.numpy()[valid], **TOL)

    hf.save(model, params, str(tmp_path / "mlm"), head="mlm")
    gen = _reload(transformers.ElectraForMaskedLM, tmp_path / "mlm")
    np.testing.assert_allclose(_theirs(gen, ids, mask, tt).logits.numpy()[valid],
                               np.asarray(out.mlm_logits)[valid], **TOL)
    hf.save(model, params, str(tmp_path / "base"), head="none")
    base = _reload(transformers.ElectraModel, tmp_path / "base")
    np.testing.assert_allclose(_theirs(base, ids, mask, tt).last_hidden_state.numpy()[valid],
                               ref.hidden_states[-1].numpy()[valid], **TOL)


def test_electra_model_and_generator_folders_round_trip(tmp_path):
    """An ElectraModel folder (no prefix) and an ElectraForMaskedLM one (generator head read)."""
    pt = _electra(transformers.ElectraModel, seed=2)
    pt.save_pretrained(tmp_path / "model")
    model, params = hf.load(str(tmp_path / "model"), dtype="float32", kernels="xla", scan_layers=True)
    ids, mask, tt = _inputs(pad_id=0, seed=2, types=True)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(_ours(model, params, ids, mask, tt).last_hidden_state)[valid],
                               _theirs(pt, ids, mask, tt).last_hidden_state.numpy()[valid], **TOL)

    gen = _electra(transformers.ElectraForMaskedLM, seed=3)
    gen.save_pretrained(tmp_path / "gen")
    model, params = hf.load(str(tmp_path / "gen"), dtype="float32", kernels="xla")
    ref = _theirs(gen, ids, mask, tt).logits.numpy()
    np.testing.assert_allclose(np.asarray(_ours(model, params, ids, mask, tt).mlm_logits)[valid], ref[valid], **TOL)
    hf.save(model, params, str(tmp_path / "out"), head="mlm")
    back = _reload(transformers.ElectraForMaskedLM, tmp_path / "out")
    np.testing.assert_allclose(_theirs(back, ids, mask, tt).logits.numpy()[valid], ref[valid], **TOL)


def test_electra_equal_widths_has_no_projection(tmp_path):
    pt = _electra(transformers.ElectraModel, embedding_size=32)
    pt.save_pretrained(tmp_path)
    cfg = hf.read_config(str(tmp_path))
    assert cfg.embedding_size is None and cfg.embed_size == 32
    _, params = hf.load(str(tmp_path), dtype="float32", with_mlm_head=False)
    assert "embeddings_project" not in params["embeddings"]


# ----------------------------------------------------------------------------- errors

def _folder_with_model_type(tmp_path, cls, model_type: str) -> str:
    """A tiny RoBERTa folder of ``cls`` whose config.json claims ``model_type``."""
    _roberta(cls).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def test_unknown_model_type_is_refused_naming_the_supported(tmp_path):
    with pytest.raises(hf.FolderError, match=r"model_type 'deberta-v2' is not supported.*'roberta'"):
        hf.load(_folder_with_model_type(tmp_path, transformers.RobertaModel, "deberta-v2"))


def test_model_type_that_disagrees_with_the_tensors_is_named(tmp_path):
    with pytest.raises(hf.FolderError, match="'roberta' checkpoint: fix config.json's model_type"):
        hf.load(_folder_with_model_type(tmp_path, transformers.RobertaForMaskedLM, "bert"))


def test_config_field_rules():
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        BertConfig(model_type="gpt2")
    with pytest.raises(ValueError, match="needs model_type 'electra'"):
        BertConfig(embedding_size=128)
    assert BertConfig().model_type == "bert" and BertConfig().embed_size == 768


# ----------------------------------------------------------------------------- tokenizer, masking, training

SENTENCES = ["the quick brown fox jumps over the lazy dog.", "unbelievable things happen, said the fox",
             "a lazy dog sleeps all day", "quick thinking wins the race"]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]     # fairseq's order: <s> 0, <pad> 1, </s> 2


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    """A tiny RoBERTa checkpoint folder: a byte-level BPE tokenizer trained here (tokenizer.json and
    tokenizer_config.json as transformers saves them) and a RobertaForMaskedLM of its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("roberta")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = transformers.RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                             cls_token="<s>", sep_token="</s>", pad_token="<pad>",
                                             unk_token="<unk>", mask_token="<mask>")
    fast.save_pretrained(out)
    n = tok.get_vocab_size()
    assert n > 261, "the BPE must have merged some pieces (whole-word test below)"
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(**{**ROBERTA, "vocab_size": n})
    transformers.RobertaForMaskedLM(cfg).save_pretrained(out)
    return str(out)


def test_roberta_special_ids_word_starts_and_masking_avoid_specials(roberta_dir, tmp_path):
    from tacl_jax import tokens
    from tacl_jax.data import packing, pipeline, tokenization
    from tacl_jax.objectives import mask_tokens

    cfg = hf.read_config(roberta_dir)
    special = tokens.run_special_ids(roberta_dir, cfg.vocab_size)
    assert special == dict(cls=0, pad=1, sep=2, unk=3, mask=4)
    # Without tokenizer_config.json the folder's vocabulary decides: <s> and no [CLS] = RoBERTa's.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text(open(os.path.join(roberta_dir, "tokenizer.json")).read())
    assert tokens.run_special_ids(str(bare), cfg.vocab_size) == special
    # Only vocab.json + merges.txt (and config.json): converted by transformers, same ids and pieces.
    slow = tmp_path / "slow"
    slow.mkdir()
    tokenization.load_tokenizer(roberta_dir).model.save(str(slow))
    (slow / "config.json").write_text(open(os.path.join(roberta_dir, "config.json")).read())
    assert tokens.run_special_ids(str(slow), cfg.vocab_size) == special
    assert (tokenization.load_tokenizer(str(slow)).encode(SENTENCES[1], add_special_tokens=False).ids
            == tokenization.load_tokenizer(roberta_dir).encode(SENTENCES[1], add_special_tokens=False).ids)

    tok = tokenization.load_tokenizer(roberta_dir)
    sents = tokenization.SentenceEncoder(tok).encode(SENTENCES)
    for (ids, starts), text in zip(sents, SENTENCES):
        pieces = [tok.id_to_token(int(i)) for i in ids]
        assert "".join(pieces).replace("Ġ", " ") == text
        # Byte-level words: a sentence's first piece, pieces after a space (Ġ), punctuation.
        want = [int(j == 0 or p.startswith("Ġ") or not p[0].isalnum()) for j, p in enumerate(pieces)]
        assert starts.tolist() == want, (pieces, starts)
    assert any(not s.all() for _, s in sents), "some word must span pieces"

    packer = packing.make_packer("full_sentences", max_len=16, cls_id=special["cls"], sep_id=special["sep"],
                                 short_seq_prob=0.0, rng=np.random.default_rng(0))
    for s in sents:
        packer.add_document([s])
    rows = packer.finish()
    batch = pipeline.collate([rows[i] for i in range(len(rows))], max_len=16, pad_id=special["pad"], with_nsp=False)
    assert (batch["input_ids"][:, 0] == special["cls"]).all()
    specials = np.asarray(list(special.values()))
    is_special = np.isin(batch["input_ids"], specials)
    for whole_word in (False, True):
        draw = jax.jit(lambda key, ws: mask_tokens(
            key, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]), max_predictions=4,
            mask_id=special["mask"], vocab_size=cfg.vocab_size, special_ids=tuple(special.values()),
            mask_prob=0.3, word_starts=ws))
        for seed in range(20):
            m = draw(jax.random.key(seed), jnp.asarray(batch["word_starts"]) if whole_word else None)
            sel = np.asarray(m.selected).astype(bool)
            assert sel.any() and not (sel & is_special).any()
            if whole_word:   # a word's pieces are selected together
                cont = (batch["word_starts"][:, 1:] == 0) & ~is_special[:, 1:] & ~is_special[:, :-1]
                assert cont.any() and (sel[:, 1:] == sel[:, :-1])[cont].all()
            assert not np.isin(np.asarray(m.targets)[np.asarray(m.weights) > 0], specials).any()


@pytest.fixture(scope="module")
def electra_dir(tmp_path_factory):
    """A tiny ElectraForPreTraining discriminator folder (embedding_size 16 != hidden 32), no tokenizer."""
    out = tmp_path_factory.mktemp("electra")
    _electra(transformers.ElectraForPreTraining).save_pretrained(out)
    return str(out)


@pytest.mark.slow   # ~40 s each on a shared 2-core CPU (compiling the step)
@pytest.mark.parametrize("family,objective", [("roberta", "tacl"), ("roberta", "mlm"), ("roberta", "coco_lm"),
                                              ("electra", "tacl")])
def test_train_step_from_a_roberta_or_electra_folder(roberta_dir, electra_dir, family, objective):
    """build_program + the pretrained params + one train step (whole-word masking on) from the
    folder: the losses are finite and the step moves the params. RoBERTa's special ids come from
    its tokenizer; the ELECTRA folder has none (BERT's toy ids are passed)."""
    import pathlib

    from tacl_jax import tokens
    from tacl_jax.config import load_config_file, override
    from tacl_jax.data import synthetic
    from tacl_jax.train import setup

    root = pathlib.Path(__file__).resolve().parents[1]
    c = load_config_file(str(root / "configs" / ("coco_lm_tiny.py" if objective == "coco_lm" else "tiny.py")))
    c.objective = objective
    c.init.from_scratch = False
    c.init.hf_path = roberta_dir if family == "roberta" else electra_dir
    c.global_batch_size = 4
    c.max_len = 16
    c.optim.warmup_steps = 0       # the first step's rate is then > 0: the step moves the params
    if objective != "coco_lm":     # the COCO-LM step masks sub-words (config.validate says so)
        c = override(c, {"masking.whole_word": True})
    special = tokens.default_special_ids(99) if family == "electra" else None
    prog = setup.build_program(c, jax.devices()[:1], special_ids=special)
    bert = prog.export_model.config
    assert bert.model_type == family
    if family == "roberta":
        assert (bert.pad_token_id, bert.type_vocab_size) == (1, 1)
        assert prog.special_ids == dict(cls=0, pad=1, sep=2, unk=3, mask=4)
    else:
        assert bert.embedding_size == 16
    init = prog.hf_params()
    state = prog.create_state_from_bert(init)
    teacher = prog.create_teacher(init)
    assert (teacher is None) == (objective != "tacl")
    if teacher is not None and family == "electra":
        assert teacher["embeddings"]["embeddings_project"]["kernel"].shape == (16, 32)
    sp = prog.special_ids
    batch = prog.global_batch(synthetic.global_batch(
        c.seed, 0, c.global_batch_size, max_len=c.max_len, vocab_size=bert.vocab_size, first_regular_id=5,
        cls_id=sp["cls"], sep_id=sp["sep"], pad_id=sp["pad"], short_seq_prob=0.3))
    word = lambda params: np.asarray(jax.device_get(  # noqa: E731
        prog.export_params(params)["embeddings"]["word_embeddings"]["embedding"]))
    before = word(state.params)
    with jax.set_mesh(prog.mesh):
        state, metrics = prog.train_step(state, teacher, batch, jax.random.key(0))
    metrics = jax.device_get(metrics)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert np.isfinite(metrics["gen_mlm_loss" if objective == "coco_lm" else "mlm_loss"])
    if objective == "tacl":
        assert np.isfinite(metrics["tacl_loss"])
    assert not np.array_equal(before, word(state.params))


# ----------------------------------------------------------------------------- readers of the config

def test_flops_count_electras_projection_and_narrow_head():
    from tacl_jax.flops import mlm_head_flops, sequence_flops

    bert = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=256)
    electra = bert.replace(model_type="electra", embedding_size=16)
    kw = dict(length=32, predictions=5, teacher=True)
    a, b = sequence_flops(bert, **kw), sequence_flops(electra, **kw)
    assert a["embeddings_project"] == 0 and b["embeddings_project"] == 2 * 16 * 64 * 32
    assert b["mlm_head_forward"] == mlm_head_flops(64, 1000, 16) * 5 == 2 * (64 * 16 + 16 * 1000) * 5
    extra = b["embeddings_project"] + b["mlm_head_forward"] - a["mlm_head_forward"]
    assert b["student_forward"] - a["student_forward"] == extra
    assert b["teacher_forward"] - a["teacher_forward"] == b["embeddings_project"]
    assert sequence_flops(bert.replace(model_type="roberta"), **kw) == a


def test_coco_lm_refuses_factorised_embeddings():
    from tacl_jax.errors import ConfigError
    from tacl_jax.models.coco_lm import CocoLM

    cfg = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, model_type="electra", embedding_size=16)
    with pytest.raises(ConfigError, match="use objective 'tacl' or 'mlm'"):
        CocoLM.build(cfg, generator_layers=1)
    CocoLM.build(cfg.replace(embedding_size=None), generator_layers=1)


def test_aot_reads_a_roberta_folders_architecture_and_tokenizer(roberta_dir):
    """tacl_jax.aot's architecture step (no compile): the family, and RoBERTa's special ids."""
    from tacl_jax import aot
    from tacl_jax.config import default_config

    c = default_config()
    c.init.hf_path = roberta_dir
    arch, special, note = aot._architecture(c)
    assert arch.model_type == "roberta" and arch.max_length == 38 and special["cls"] == 0 and roberta_dir in note


def test_isotropy_and_analysis_batches_pad_with_the_models_pad():
    from tacl_jax.analyze import _batches

    (x, m), = list(_batches([np.array([0, 7, 2]), np.array([0, 8, 9, 10, 2])], batch_size=2, pad_id=1))
    assert (x[m == 0] == 1).all() and x[0, :3].tolist() == [0, 7, 2]


def test_electra_params_shard_by_their_logical_names(electra_dir):
    """The projection and the narrow tables/head get specs from parallel's rule table (fsdp 2,
    tensor 2 on 4 of the fake CPU devices); nothing compiles."""
    import pathlib

    from jax.sharding import PartitionSpec as P

    from tacl_jax import tokens
    from tacl_jax.config import load_config_file
    from tacl_jax.train import setup

    c = load_config_file(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py"))
    c.objective = "mlm"
    c.init.from_scratch = False
    c.init.hf_path = electra_dir
    c.mesh.update(data=1, fsdp=2, tensor=2)
    c.global_batch_size = 4
    c.max_len = 16
    prog = setup.build_program(c, jax.devices()[:4], special_ids=tokens.default_special_ids(99))
    sh = prog.state_shardings.params
    assert sh["embeddings"]["embeddings_project"]["kernel"].spec == P(None, "fsdp")
    assert sh["embeddings"]["word_embeddings"]["embedding"].spec == P("tensor", "fsdp")
    assert sh["mlm_transform"]["kernel"].spec == P("fsdp", None)
    assert prog.abstract_state.params["mlm_norm"]["scale"].shape == (16,)


@pytest.mark.parametrize("family", ["roberta", "electra"])
def test_omitted_config_keys_take_the_transformers_class_defaults(tmp_path, family):
    """A sparse config.json reads as transformers reads it (its config class fills the gaps)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, "num_hidden_layers": 2}))
    ours = hf.read_config(str(tmp_path))
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path))
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "pad_token_id",
              "layer_norm_eps", "type_vocab_size", "max_position_embeddings"):
        assert getattr(ours, k) == getattr(theirs, k), k
    if family == "electra":
        assert ours.embedding_size == theirs.embedding_size == 128
