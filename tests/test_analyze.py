"""The self-similarity analysis: equal to a naive double loop, micro-averaged across batches, and
the command writes its JSON and non-empty plots."""

import json
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tacl_jax import analyze, hf
from tacl_jax.data import testing
from tacl_jax.models import BertConfig, BertModel

TINY = dict(vocab_size=256, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=64, dtype="float32", with_mlm_head=False, with_pooler=False)


@pytest.fixture(scope="module")
def tiny():
    model = BertModel(BertConfig(**TINY))
    params = jax.jit(lambda r: model.init(r, jnp.zeros((1, 8), jnp.int32))["params"])(jax.random.key(0))
    return model, params


def _hidden_states(model, params, row, pad_to=32):
    """All hidden states of one sentence, float64 ``[n, H]`` each. The sentence is padded to
    ``pad_to`` with its attention mask (one compilation for all lengths);
    ``test_padding_is_invisible`` checks that this equals the sentence alone."""
    fn = _HIDDEN.setdefault(model, jax.jit(
        lambda p, x, m: model.apply({"params": p}, x, m, output_hidden_states=True, heads=False).hidden_states))
    n = len(row)
    x = np.zeros((1, max(pad_to, n)), np.int32)
    x[0, :n] = row
    return [np.asarray(h[0, :n], np.float64) for h in fn(params, jnp.asarray(x), jnp.asarray((x != 0) * 1))]


_HIDDEN = {}


def _random_sentences(seed, num=5, max_len=24):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, max_len + 1, num)
    ids = np.zeros((num, max_len), np.int32)
    mask = np.zeros((num, max_len), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = np.concatenate([[101 % 256], rng.integers(5, 256, n - 2), [102 % 256]])
        mask[b, :n] = 1
    return ids, mask, lengths


def _naive(model, params, ids, lengths):
    """Each sentence alone (no padding), a plain double loop over pairs i < j."""
    sums = np.zeros(model.config.num_hidden_layers + 1)
    count = 0
    for row, n in zip(ids, lengths):
        for layer, h in enumerate(_hidden_states(model, params, row[:n])):
            for i in range(n):
                for j in range(i + 1, n):
                    sums[layer] += h[i] @ h[j] / (np.linalg.norm(h[i]) * np.linalg.norm(h[j]))
        count += n * (n - 1) // 2
    return sums, count


def test_self_similarity_matches_naive_double_loop(tiny):
    model, params = tiny
    ids, mask, lengths = _random_sentences(0)
    got = analyze.self_similarity(model, params, ids, mask)
    sums, count = _naive(model, params, ids, lengths)
    assert got.shape == (model.config.num_hidden_layers + 1,)
    np.testing.assert_allclose(got, sums / count, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_micro_average_over_batches(tiny):
    """Sums and counts add across batches: the corpus score is not a mean of batch means."""
    model, params = tiny
    a_ids, a_mask, a_len = _random_sentences(1, num=3)
    b_ids, b_mask, b_len = _random_sentences(2, num=4)
    sa, ca = analyze.self_similarity_sums(model, params, a_ids, a_mask)
    sb, cb = analyze.self_similarity_sums(model, params, b_ids, b_mask)
    ns_a, nc_a = _naive(model, params, a_ids, a_len)
    ns_b, nc_b = _naive(model, params, b_ids, b_len)
    np.testing.assert_allclose(ca[0], nc_a)
    np.testing.assert_allclose((sa + sb) / (ca + cb), (ns_a + ns_b) / (nc_a + nc_b), rtol=1e-5, atol=1e-6)
    # The length-bucketed batching of a corpus gives the same micro-average.
    rows = [a_ids[i, :n] for i, n in enumerate(a_len)] + [b_ids[i, :n] for i, n in enumerate(b_len)]
    r = analyze.corpus_self_similarity(model, params, rows, batch_size=3)
    np.testing.assert_allclose(r["self_similarity"], (ns_a + ns_b) / (nc_a + nc_b), rtol=1e-5, atol=1e-6)
    assert r["pair_count"] == nc_a + nc_b


def test_padding_is_invisible(tiny):
    model, params = tiny
    ids, _, lengths = _random_sentences(4, num=1)
    row = ids[0, :lengths[0]]
    alone = model.apply({"params": params}, jnp.asarray(row[None]), output_hidden_states=True, heads=False)
    for a, b in zip(alone.hidden_states, _hidden_states(model, params, row)):
        np.testing.assert_allclose(np.asarray(a[0]), b, rtol=1e-5, atol=1e-5)


def test_cosine_matrix_is_the_last_layer(tiny):
    model, params = tiny
    ids, _, lengths = _random_sentences(3, num=1)
    row = ids[0, :lengths[0]]
    mat = analyze.cosine_matrix(model, params, row)
    h = _hidden_states(model, params, row)[-1]
    h = h / np.linalg.norm(h, axis=-1, keepdims=True)
    np.testing.assert_allclose(mat, h @ h.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.diag(mat), 1.0, atol=1e-5)


@pytest.mark.slow
def test_command_writes_json_and_plots(tmp_path, capsys):
    words = ("hello", "world") + tuple(testing.WORDS[:60])
    tok_dir = testing.write_toy_tokenizer(str(tmp_path / "tok"), extra_words=words)
    cfg = BertConfig(**dict(TINY, vocab_size=512, with_pooler=True))
    big = BertModel(cfg)
    init = jax.jit(lambda r: big.init(r, jnp.zeros((1, 8), jnp.int32))["params"])
    dirs = []
    for seed in (0, 1):
        p = init(jax.random.key(seed))
        dirs.append(hf.save(big, jax.tree.map(np.asarray, p), str(tmp_path / f"m{seed}"), head="none",
                            tokenizer_from=tok_dir))
    docs = [[" ".join(words[i:i + 6 + i % 5]).capitalize() + "." for i in range(d, d + 8)] for d in range(6)]
    corpus = testing.write_text_corpus(str(tmp_path / "corpus.txt"), docs)
    out = tmp_path / "out"
    analyze.main([f"--hf={dirs[0]}", f"--hf={dirs[1]}", "--labels=A,B", f"--corpus={corpus}", f"--out={out}",
                  "--max_sentences=20", "--batch_size=8"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(line["self_similarity"]) == {"A", "B"}
    report = json.loads((out / "self_similarity.json").read_text())
    assert report["num_sentences"] == 20
    for r in report["models"]:
        assert len(r["self_similarity"]) == cfg.num_hidden_layers + 1
        assert all(-1.0 <= v <= 1.0 for v in r["self_similarity"])
    for name in ("self_similarity.png", "cosine_heatmap.png"):
        data = (out / name).read_bytes()
        assert len(data) > 2000 and data[:8] == b"\x89PNG\r\n\x1a\n", name


def test_workdir_export_picks_latest_then_final_then_newest_step(tmp_path):
    with pytest.raises(FileNotFoundError, match="no Hugging Face export"):
        analyze.workdir_export(str(tmp_path))
    for name in ("step_5", "step_20", "step_100"):
        (tmp_path / "export" / name).mkdir(parents=True)
    assert analyze.workdir_export(str(tmp_path)).endswith("step_100")
    (tmp_path / "export" / "final").mkdir()
    assert analyze.workdir_export(str(tmp_path)).endswith("final")
    (tmp_path / "export" / "latest").mkdir()
    assert analyze.workdir_export(str(tmp_path)).endswith("latest")


@pytest.mark.slow
def test_training_run_analyses_its_export_on_held_out_sentences(tmp_path, caplog):
    """A tiny real TaCL run (text corpus, init from an HF folder) ends with workdir/analysis/: its
    numbers are what tacl_jax.analyze computes directly on the export and on the init folder."""
    import logging
    import pathlib

    from tacl_jax.config import load_config_file
    from tacl_jax.train import loop

    tok_dir = testing.write_toy_tokenizer(str(tmp_path / "tok"), extra_words=testing.WORDS)
    corpus = testing.write_text_corpus(str(tmp_path / "corpus.txt"), testing.random_documents(300, seed=0))
    init_model = BertModel(BertConfig(**dict(TINY, vocab_size=512, hidden_size=32, num_attention_heads=4, with_pooler=True,
                                             intermediate_size=64)))
    init_params = jax.jit(lambda r: init_model.init(r, jnp.zeros((1, 8), jnp.int32))["params"])(jax.random.key(3))
    init_dir = hf.save(init_model, jax.tree.map(np.asarray, init_params), str(tmp_path / "init"), head="none",
                       tokenizer_from=tok_dir)

    config = load_config_file(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py"))
    config.init.from_scratch = False
    config.init.hf_path = init_dir
    config.data.source = f"text:{corpus}"
    config.data.eval_fraction = 0.1
    config.num_train_steps = 3
    config.eval_batches = 1
    config.analysis.num_sentences = 40
    config.analysis.batch_size = 16
    workdir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="tacl_jax.train"):
        assert loop.train_and_evaluate(config, str(workdir))["status"] == "finished"
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("analysis:")]
    assert len(line) == 1 and "last-layer self-similarity" in line[0] and "(init " in line[0], line

    out = workdir / "analysis"
    report = json.loads((out / "self_similarity.json").read_text())
    assert report["num_sentences"] == 40 and report["max_len"] == 64   # = max_position_embeddings
    assert [r["label"] for r in report["models"]] == ["init", "after 3 steps (tacl)"]
    for name in ("self_similarity.png", "cosine_heatmap.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    direct = analyze.analyze([init_dir, str(workdir / "export" / "final")], f"text:{corpus}", None,
                             max_sentences=40, max_len=64, batch_size=16, seed=config.seed, split="heldout",
                             eval_fraction=0.1)
    for got, want in zip(report["models"], direct["models"]):
        np.testing.assert_allclose(got["self_similarity"], want["self_similarity"], rtol=1e-6)
        assert got["last_layer"] == pytest.approx(want["last_layer"], rel=1e-6)
        assert got["pair_count"] == want["pair_count"]
    assert report["models"][0]["last_layer"] != report["models"][1]["last_layer"]   # training moved it
    assert f"{report['models'][1]['last_layer']:.4f}" in line[0]


def test_no_held_out_text_is_a_reason_not_an_error(tmp_path):
    from tacl_jax.data import config as data_config

    def dc(**kw):
        c = data_config.default_config()
        c.update(kw)
        return c

    with pytest.raises(analyze.NoSentences, match="random ids"):
        analyze.heldout_sentences(dc(source="synthetic"), max_sentences=5)
    corpus = testing.write_text_corpus(str(tmp_path / "c.txt"), testing.random_documents(20, seed=1))
    with pytest.raises(analyze.NoSentences, match="eval_fraction=0"):
        analyze.heldout_sentences(dc(source=f"text:{corpus}", eval_fraction=0.0), max_sentences=5)
    with pytest.raises(analyze.NoSentences, match="not readable"):
        analyze.heldout_sentences(dc(source=f"text:{tmp_path}/missing.txt"), max_sentences=5)
    got, source = analyze.heldout_sentences(dc(source=f"text:{corpus}", eval_fraction=0.2), max_sentences=5)
    assert len(got) == 5 and source == f"text:{corpus}"
