"""A TaCL teacher of its own (``tacl.teacher_hf_path``), larger than the student: the loss with the
learned projection against a numpy reference, no gradient into the teacher, the teacher read from
its folder and sharded by the student's rules, the projection trained and checkpointed but never
exported, the FLOPs formula against the compiled matmuls, and the clear errors."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_text
from tacl_jax import hf
from tacl_jax.config import ConfigError, load_config_file, override, validate
from tacl_jax.data import synthetic
from tacl_jax.flops import encoder_flops_per_token, sequence_flops
from tacl_jax.models import BertConfig, BertModel
from tacl_jax.models.tacl_student import TaclStudent
from tacl_jax.train import setup
from tacl_jax.train import teacher as teacher_lib
from tacl_jax.train.step import make_loss_fn, prepare_batch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# configs/tiny.py's student is 2 layers × 32 wide over 512 ids; the teacher is deeper and wider.
TEACHER = BertConfig(vocab_size=512, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=64, dtype="float32")


def _save_random_bert(cfg: BertConfig, folder, seed: int) -> str:
    model = BertModel(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"])
    hf.save(model, params, str(folder), head="none", overwrite=True)
    return str(folder)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return _save_random_bert(TEACHER, tmp_path_factory.mktemp("teacher") / "bert48", seed=7)


def _config(teacher_dir, **overrides):
    c = load_config_file(str(ROOT / "configs" / "tiny.py"))
    c.global_batch_size, c.max_len = 8, 16
    c.model.hidden_dropout_prob = c.model.attention_probs_dropout_prob = 0.0
    return override(c, {"tacl.teacher_hf_path": teacher_dir, **overrides})


def _batch(prog, step=0):
    c, sp = prog.config, prog.special_ids
    return prog.global_batch(synthetic.global_batch(
        c.seed, step, c.global_batch_size, max_len=c.max_len, vocab_size=prog.model.config.vocab_size,
        first_regular_id=5, cls_id=sp["cls"], sep_id=sp["sep"], pad_id=sp["pad"], short_seq_prob=0.3))


def _np_tacl(student_h, teacher_h, kernel, bias, positions, weights, key_mask, tau):
    """The reference: ``student_h [B, L, Hs]``, ``teacher_h [B, L, Ht]`` -> (Σ nll, Σ correct) over the
    anchors (``positions [B, P]`` with ``weights``), in float64."""
    s = np.take_along_axis(student_h, positions[..., None], axis=1) @ kernel + bias       # [B, P, Ht]
    s = s / np.linalg.norm(s, axis=-1, keepdims=True)
    t = teacher_h / np.linalg.norm(teacher_h, axis=-1, keepdims=True)
    scores = np.einsum("bpd,bjd->bpj", s, t) / tau
    scores = np.where(key_mask[:, None, :] > 0, scores, -1e9)
    m = scores.max(-1, keepdims=True)
    logz = (m + np.log(np.exp(scores - m).sum(-1, keepdims=True)))[..., 0]
    positive = np.take_along_axis(scores, positions[..., None], axis=-1)[..., 0]
    correct = (scores.argmax(-1) == positions).astype(np.float64)
    return ((logz - positive) * weights).sum(), (correct * weights).sum()


def test_student_gets_a_projection_and_the_teacher_is_the_folder(teacher_dir):
    prog = setup.build_program(_config(teacher_dir), jax.devices()[:1])
    assert isinstance(prog.model, TaclStudent) and not prog.teacher_from_student
    assert prog.teacher_model.config.hidden_size == 48 and prog.teacher_model.config.num_hidden_layers == 3
    assert prog.teacher_model.config.dtype == prog.model.config.dtype == "float32"   # the run's numerics
    shapes = jax.tree.map(lambda a: a.shape, prog.abstract_state.params["teacher_projection"])
    assert shapes == {"kernel": (32, 48), "bias": (48,)}
    teacher = jax.device_get(prog.create_teacher())
    _, want = hf.load(teacher_dir, dtype="float32")
    for path, got in jax.tree_util.tree_leaves_with_path(teacher):
        ref = want
        for k in path:
            ref = ref[k.key]
        np.testing.assert_array_equal(got, ref, err_msg=jax.tree_util.keystr(path))


def test_loss_with_projection_matches_numpy(teacher_dir):
    """The TaCL sums of the step's loss function (the student's gathered last layer, projected)
    equal a float64 numpy computation from the two models' full hidden states."""
    prog = setup.build_program(_config(teacher_dir), jax.devices()[:1])
    state, teacher = prog.create_state(), prog.create_teacher()
    # A projection far from its init, so that a wrong kernel or bias would show.
    rng = np.random.default_rng(0)
    proj = {"kernel": rng.normal(0, 0.3, (32, 48)).astype(np.float32),
            "bias": rng.normal(0, 0.3, (48,)).astype(np.float32)}
    params = {**state.params, "teacher_projection": jax.tree.map(jnp.asarray, proj)}
    batch = _batch(prog)
    mb, counts = prepare_batch(prog.model, prog.step_cfg, batch, jax.random.key(5))
    loss_fn = make_loss_fn(prog.model, prog.step_cfg, prog.teacher_model, deterministic=True)
    _, sums = jax.jit(loss_fn)(params, teacher, mb, counts, jax.random.key(0))
    student_h = prog.model.bert.apply({"params": params["bert"]}, mb["masked_ids"], mb["attention_mask"],
                                      mb["token_type_ids"], heads=False).last_hidden_state
    teacher_h = prog.teacher_model.apply({"params": teacher}, mb["input_ids"], mb["attention_mask"],
                                         mb["token_type_ids"], heads=False).last_hidden_state
    f64 = lambda x: np.asarray(x, np.float64)
    nll, correct = _np_tacl(f64(student_h), f64(teacher_h), f64(proj["kernel"]), f64(proj["bias"]),
                            np.asarray(mb["positions"]), f64(mb["weights"]), np.asarray(mb["attention_mask"]),
                            prog.step_cfg.temperature)
    assert float(sums["n_anchor"]) == float(np.asarray(mb["weights"]).sum()) > 0
    np.testing.assert_allclose(float(sums["tacl_nll"]), nll, rtol=1e-4)
    assert float(sums["tacl_correct"]) == correct


def test_teacher_gets_no_gradient_and_the_projection_trains(teacher_dir):
    prog = setup.build_program(_config(teacher_dir, **{"optim.warmup_steps": 0}), jax.devices()[:1])
    state, teacher = prog.create_state(), prog.create_teacher()
    mb, counts = prepare_batch(prog.model, prog.step_cfg, _batch(prog), jax.random.key(1))
    loss_fn = make_loss_fn(prog.model, prog.step_cfg, prog.teacher_model)
    g_student, g_teacher = jax.jit(jax.grad(lambda p, t: loss_fn(p, t, mb, counts, jax.random.key(2))[0],
                                            argnums=(0, 1)))(state.params, teacher)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_teacher))
    assert float(jnp.abs(g_student["teacher_projection"]["kernel"]).max()) > 0
    assert float(jnp.abs(g_student["bert"]["encoder"]["layer_1"]["output"]["kernel"]).max()) > 0
    before = jax.device_get((state.params["teacher_projection"], teacher))
    with jax.set_mesh(prog.mesh):
        state, _ = prog.train_step(state, teacher, _batch(prog), jax.random.key(0))
    after = jax.device_get((state.params["teacher_projection"], teacher))
    assert not np.array_equal(before[0]["kernel"], after[0]["kernel"])
    jax.tree.map(np.testing.assert_array_equal, before[1], after[1])


def test_teacher_is_sharded_by_the_students_rules(teacher_dir):
    """On a 2×2×2 mesh every teacher leaf has the PartitionSpec of the student leaf with the same
    logical names; without a teacher of its own the teacher's shardings are the student encoder's."""
    devices = jax.devices()[:8]
    c = _config(teacher_dir, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    prog = setup.build_program(c, devices)
    student = prog.state_shardings.params["bert"]
    for path, sh in jax.tree_util.tree_leaves_with_path(prog.teacher_shardings):
        ref = student
        for k in path:     # the teacher's 3 layers against the student's layer 0
            ref = ref["layer_0" if k.key.startswith("layer_") else k.key]
        assert sh.spec == ref.spec, jax.tree_util.keystr(path)
    specs = {tuple(sh.spec) for sh in jax.tree.leaves(prog.teacher_shardings)}
    assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs)
    own = setup.build_program(override(c.copy_and_resolve_references(),
                                       {"tacl.teacher_hf_path": "", "init.from_scratch": True}), devices)
    assert own.teacher_shardings == setup.strip_heads(own.state_shardings.params)
    teacher = prog.create_teacher()
    assert teacher["encoder"]["layer_0"]["attention"]["query"]["kernel"].sharding.spec == \
        prog.teacher_shardings["encoder"]["layer_0"]["attention"]["query"]["kernel"].spec


@pytest.mark.slow
def test_projection_is_checkpointed_never_exported_and_resume_is_exact(teacher_dir, tmp_path):
    """4 steps then 2 more from the checkpoint == 6 uninterrupted (the projection and its Adam
    moments restored, the teacher re-read); the export is a plain BERT that transformers loads."""
    from tacl_jax.train.loop import train_and_evaluate

    def config(**kw):
        return _config(teacher_dir, **{"num_train_steps": 6, "log_every": 1, "checkpoint.every": 2,
                                       "analysis.enabled": False, **kw})

    train_and_evaluate(config(steps_per_run=4), str(tmp_path / "a"))
    resumed = train_and_evaluate(config(), str(tmp_path / "a"))
    ref = train_and_evaluate(config(), str(tmp_path / "b"))
    got, want = jax.device_get((resumed["state"].params, ref["state"].params))
    assert "teacher_projection" in got
    jax.tree.map(np.testing.assert_array_equal, got, want)
    export = tmp_path / "b" / "export" / "final"
    _, params = hf.load(str(export), dtype="float32")
    assert "teacher_projection" not in params
    import transformers
    model, info = transformers.BertForMaskedLM.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.hidden_size == 32


def test_flops_count_the_teacher_and_the_projection():
    student = BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64)
    kw = dict(length=16, predictions=3, teacher=True)
    same, big = sequence_flops(student, **kw), sequence_flops(student, teacher_cfg=TEACHER, **kw)
    assert big["student_forward"] == same["student_forward"]
    assert big["teacher_forward"] == 3 * encoder_flops_per_token(1, 48, 96, 16) * 16
    assert big["tacl"] == 2 * 2 * 16 * 48 * 3 and big["projection"] == 3 * 2 * 32 * 48 * 3
    assert same["projection"] == 0
    assert big["total"] == 3 * big["student_forward"] + big["teacher_forward"] + big["tacl"] + big["projection"]


@pytest.mark.slow
def test_flops_formula_matches_the_compiled_step(teacher_dir):
    """``flops_per_step`` with a larger teacher against the matmuls of the compiled train step
    (within 2%: bias gradients left out, as in tests/test_gathered_last_layer.py)."""
    prog = setup.build_program(_config(teacher_dir), jax.devices()[:1])
    hlo = prog.lower().compile().as_text()
    got = sum(d.flops for d in hlo_text.dots(hlo) if 1 not in d.lhs_shape + d.rhs_shape + d.out_shape)
    np.testing.assert_allclose(got, prog.flops_per_step, rtol=0.02)


def _tokenizer_folder(folder, words):
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_clear_errors(teacher_dir, tmp_path):
    # Another vocabulary size: refused when the program is built.
    other = _save_random_bert(TEACHER.replace(vocab_size=640), tmp_path / "v640", seed=1)
    with pytest.raises(ConfigError, match="vocab_size 640 but the student has 512"):
        setup.build_program(_config(other), jax.devices()[:1])
    # Same size, another tokenizer: refused before the teacher is loaded.
    student_tok = _tokenizer_folder(tmp_path / "tok_a", [f"a{i}" for i in range(100)])
    _tokenizer_folder(pathlib.Path(teacher_dir), [f"b{i}" for i in range(100)])
    try:
        c = _config(teacher_dir, **{"init.tokenizer_path": student_tok})
        with pytest.raises(ConfigError, match="teacher's tokenizer .* differs from the run's"):
            teacher_lib.check_same_tokenizer(c)
        _tokenizer_folder(pathlib.Path(teacher_dir), [f"a{i}" for i in range(100)])
        teacher_lib.check_same_tokenizer(c)     # the same vocabulary passes
    finally:
        (pathlib.Path(teacher_dir) / "tokenizer.json").unlink()
    # Only TaCL has a teacher.
    with pytest.raises(ConfigError, match="teacher_hf_path is set but objective is 'mlm'"):
        validate(_config(teacher_dir, objective="mlm"))
    # A teacher of its own satisfies "TaCL needs a pretrained teacher" without init.hf_path.
    validate(_config(teacher_dir, **{"init.from_scratch": False}))
