"""Fine-tuning (tacl_jax.finetune): heads and losses against transformers with identical weights,
the metrics against scipy / hand-computed references, SQuAD windows and span decoding, the data
readers and their errors, and short runs (learning, resume = uninterrupted, the CLI)."""

import json
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # in the test extras; never skipped in CI
import transformers  # noqa: E402

from tacl_jax import hf  # noqa: E402
from tacl_jax.config import load_config_file  # noqa: E402
from tacl_jax.data.tokenization import load_tokenizer  # noqa: E402
from tacl_jax.finetune import data as data_lib, heads, metrics, squad, tasks  # noqa: E402
from tacl_jax.finetune import train as train_lib  # noqa: E402
from tacl_jax.finetune.config import default_config  # noqa: E402
import test_hf  # noqa: E402
from test_hf import _inputs  # noqa: E402  (the padded batch of the HF tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torch_model(cls, seed=0, **kw):
    return test_hf._torch_model(cls, seed, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)


def _ours(pt, folder, kind, num_labels):
    """Our head module and params with the torch model's weights."""
    pt.save_pretrained(folder)
    bert, params = hf.load(str(folder), dtype="float32", with_pooler=kind != "qa", with_mlm_head=False,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = heads.build_model(bert.config, kind, num_labels)
    name = "qa_outputs" if kind == "qa" else "classifier"
    lin = getattr(pt, name)
    head = {"kernel": lin.weight.detach().numpy().T, "bias": lin.bias.detach().numpy()}
    return model, {"bert": params, name: head}


def _batch(ids, mask, types_, **extra):
    b = {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(mask, jnp.int32),
         "token_type_ids": jnp.asarray(types_, jnp.int32), "weights": jnp.ones(ids.shape[0], jnp.float32)}
    return {**b, **{k: jnp.asarray(v) for k, v in extra.items()}}


@pytest.mark.parametrize("num_labels", [3, 1])
def test_classifier_logits_and_loss_match_transformers(tmp_path, num_labels):
    """BertForSequenceClassification: logits to 1e-5; CE (3 labels) / MSE (1 label) loss and the
    classifier's gradient as torch's on the same batch and weights (dropout off)."""
    pt = _torch_model(transformers.BertForSequenceClassification, num_labels=num_labels)
    model, params = _ours(pt, tmp_path, "regression" if num_labels == 1 else "classification", num_labels)
    ids, mask, types_ = _inputs()
    labels = np.array([0, 2, 1]) if num_labels == 3 else np.array([0.5, -1.0, 2.0], np.float32)
    t_labels = torch.tensor(labels)
    ref = pt(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types_),
             labels=t_labels)
    ref.loss.backward()
    kind = "regression" if num_labels == 1 else "classification"
    batch = _batch(ids, mask, types_, labels=labels.astype(np.int32 if num_labels == 3 else np.float32))
    (loss, logits), grads = jax.value_and_grad(
        lambda p: heads.loss_and_outputs(model, kind, p, batch), has_aux=True)(params)
    np.testing.assert_allclose(np.asarray(logits), ref.logits.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ref.loss.item(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["classifier"]["kernel"]), pt.classifier.weight.grad.numpy().T,
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["roberta", "electra"])
def test_roberta_and_electra_classifiers_are_their_families_heads(tmp_path, family):
    """RobertaForSequenceClassification (tanh) and ElectraForSequenceClassification (exact GELU;
    E 16 ≠ H 32): no pooler, the first token -> dense -> act -> out_proj. Logits to 1e-5, the CE
    loss and both head layers' gradients as torch's; the fine-tuning run's config reads no pooler."""
    import test_backbones  # pylint: disable=import-outside-toplevel
    build, cls = ((test_backbones._roberta, transformers.RobertaForSequenceClassification) if family == "roberta"
                  else (test_backbones._electra, transformers.ElectraForSequenceClassification))
    pt = build(cls, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pt.save_pretrained(tmp_path)
    assert train_lib.bert_config(default_config(), str(tmp_path), "classification").with_pooler is False
    bert, params = hf.load(str(tmp_path), dtype="float32", with_pooler=False, with_mlm_head=False,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = heads.build_model(bert.config, "classification", 3)
    lin = {n: {"kernel": getattr(pt.classifier, n).weight.detach().numpy().T,
               "bias": getattr(pt.classifier, n).bias.detach().numpy()} for n in ("dense", "out_proj")}
    params = {"bert": params, "classifier": lin}
    ids, mask, types_ = test_backbones._inputs(pt.config.pad_token_id)
    labels = np.array([0, 2, 1])
    ref = pt(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types_),
             labels=torch.tensor(labels))
    ref.loss.backward()
    batch = _batch(ids, mask, types_, labels=labels.astype(np.int32))
    (loss, logits), grads = jax.value_and_grad(
        lambda p: heads.loss_and_outputs(model, "classification", p, batch), has_aux=True)(params)
    np.testing.assert_allclose(np.asarray(logits), ref.logits.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ref.loss.item(), rtol=1e-5, atol=1e-6)
    for n in ("dense", "out_proj"):
        np.testing.assert_allclose(np.asarray(grads["classifier"][n]["kernel"]),
                                   getattr(pt.classifier, n).weight.grad.numpy().T, atol=1e-5, rtol=1e-4)
    assert "pooler" not in params["bert"]


@pytest.mark.parametrize("family,kind", [("bert", "classification"), ("bert", "regression"), ("bert", "qa"),
                                         ("roberta", "classification"), ("roberta", "qa"),
                                         ("electra", "classification"), ("electra", "qa")])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, family, kind):
    """A fine-tuned model (encoder from a perturbed torch folder, head random with non-zero biases)
    -> finetune.export -> transformers' *ForSequenceClassification / *ForQuestionAnswering of its
    family with no missing or unexpected keys, the task's labels and problem_type, and logits equal
    to ours to 1e-5."""
    import test_backbones  # pylint: disable=import-outside-toplevel
    from tacl_jax.finetune import export as export_lib  # pylint: disable=import-outside-toplevel
    base = {"bert": lambda: _torch_model(transformers.BertModel),
            "roberta": lambda: test_backbones._roberta(transformers.RobertaModel),
            "electra": lambda: test_backbones._electra(transformers.ElectraModel)}[family]()
    base.save_pretrained(tmp_path / "base")
    uses_pooler = family == "bert" and kind != "qa"
    bert, enc = hf.load(str(tmp_path / "base"), dtype="float32", with_pooler=uses_pooler, with_mlm_head=False,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, seed=3)
    task = tasks.Task(name=kind, kind=kind, labels=("neg", "neu", "pos") if kind == "classification" else ())
    model = heads.build_model(bert.config, kind, task.num_labels)
    ids, mask, types_ = test_backbones._inputs(base.config.pad_token_id, types=family != "roberta")
    params = jax.tree.map(np.asarray, model.init(jax.random.key(1), jnp.asarray(ids))["params"])
    rng = np.random.default_rng(0)
    head = {k: jax.tree.map(lambda a: a + 0.1 * rng.standard_normal(a.shape).astype(a.dtype), v)
            for k, v in params.items() if k != "bert"}
    params = {"bert": enc, **head}
    export_lib.save(model, params, str(tmp_path / "export"), task)
    pt = test_backbones._reload(getattr(transformers, export_lib.architecture(bert.config, kind)),
                                str(tmp_path / "export"))
    if kind != "qa":
        assert pt.config.problem_type == ("regression" if kind == "regression" else "single_label_classification")
        assert pt.config.num_labels == task.num_labels
        if kind == "classification":
            assert pt.config.id2label == {0: "neg", 1: "neu", 2: "pos"}
    ours = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types_))
    with torch.no_grad():
        theirs = pt(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types_))
    if kind == "qa":
        np.testing.assert_allclose(np.asarray(ours[0]), theirs.start_logits.numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(ours[1]), theirs.end_logits.numpy(), atol=1e-5, rtol=1e-5)
    else:
        np.testing.assert_allclose(np.asarray(ours), theirs.logits.numpy(), atol=1e-5, rtol=1e-5)


def test_qa_logits_and_loss_match_transformers(tmp_path):
    pt = _torch_model(transformers.BertForQuestionAnswering)
    model, params = _ours(pt, tmp_path, "qa", 2)
    ids, mask, types_ = _inputs()
    starts, ends = np.array([9, 10, 3]), np.array([12, 10, 5])
    ref = pt(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types_),
             start_positions=torch.tensor(starts), end_positions=torch.tensor(ends))
    batch = _batch(ids, mask, types_, start_positions=starts.astype(np.int32), end_positions=ends.astype(np.int32))
    loss, (s, e) = heads.loss_and_outputs(model, "qa", params, batch)
    np.testing.assert_allclose(np.asarray(s), ref.start_logits.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(e), ref.end_logits.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ref.loss.item(), rtol=1e-5)


def test_heads_carry_logical_axis_names(tmp_path):
    pt = _torch_model(transformers.BertForSequenceClassification, num_labels=2)
    pt.save_pretrained(tmp_path)
    cfg = hf.read_config(str(tmp_path)).replace(dtype="float32")
    boxed = jax.eval_shape(lambda r: heads.build_model(cfg, "classification", 2).init(
        r, jnp.zeros((1, 8), jnp.int32))["params"], jax.random.key(0))
    assert boxed["classifier"]["kernel"].names == ("embed", None)
    assert boxed["bert"]["pooler"]["kernel"].names == ("embed", "embed_out")


@pytest.mark.slow
def test_train_step_on_a_sharded_mesh_equals_one_device(tmp_path):
    """The train step with params over fsdp × tensor and rows over data × fsdp (the logical rules
    of tacl_jax.parallel) gives one device's loss and update."""
    import flax.linen as nn

    from tacl_jax import parallel
    from tacl_jax.train import setup

    pt = _torch_model(transformers.BertForSequenceClassification, num_labels=3)
    pt.save_pretrained(tmp_path)
    bert, bert_params = hf.load(str(tmp_path), dtype="float32", with_pooler=True, with_mlm_head=False)
    model = heads.build_model(bert.config, "classification", 3)
    tx, schedule = train_lib.make_optimizer(default_config().optim, 10)
    ids, mask, types_ = _inputs(batch=4)
    host = {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32),
            "token_type_ids": types_.astype(np.int32), "labels": np.array([0, 2, 1, 1], np.int32),
            "weights": np.ones(4, np.float32)}
    got = []
    for sizes in (dict(data=1, fsdp=1, tensor=1), dict(data=2, fsdp=2, tensor=2)):
        mesh = parallel.make_mesh(sizes, jax.devices()[:int(np.prod(list(sizes.values())))])
        rules = parallel.rules_from_config(())
        state, _ = setup.create_state(model, tx, mesh, rules, 0, 17, bert_params, at="bert")
        step = jax.jit(train_lib.make_train_step(model, "classification", tx, schedule, 0))
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            state, m = step(state, parallel.global_batch(host, mesh))
        got.append((float(m["loss"]), jax.device_get(state.params)))
    assert got[0][0] == pytest.approx(got[1][0], rel=1e-5)
    # Adam's first step is ±lr where a gradient is ~0: rounding may flip it, hence 2·lr.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=4.1e-5), got[0][1], got[1][1])


def test_weight_decay_mask_is_trainers():
    params = {"bert": {"encoder": {"layer_0": {"attention": {"query": {"kernel": np.zeros((4, 2, 2)),
                                                                         "bias": np.zeros((2, 2))}},
                                               "attention_norm": {"scale": np.zeros(4), "bias": np.zeros(4)}}}},
              "classifier": {"kernel": np.zeros((4, 2)), "bias": np.zeros(2)}}
    m = train_lib.hf_decay_mask(params)
    q = m["bert"]["encoder"]["layer_0"]["attention"]["query"]
    assert q["kernel"] and not q["bias"]                       # a 2-D attention bias: no decay
    assert not m["bert"]["encoder"]["layer_0"]["attention_norm"]["scale"]
    assert m["classifier"]["kernel"] and not m["classifier"]["bias"]


# ----------------------------------------------------------------------------- metrics

def test_metrics_match_references():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.normal(size=50)
    y = x + rng.normal(size=50)
    y[:10] = np.round(y[:10])   # ties
    x[5:15] = 1.0
    assert metrics.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert metrics.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    np.testing.assert_array_equal(metrics.rankdata(x), stats.rankdata(x))
    # Hand-computed: TP 2, FP 1, FN 1, TN 2 -> F1 2/3, MCC (2*2-1*1)/sqrt(3*3*3*3) = 1/3.
    p, t = [1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0]
    assert metrics.accuracy(p, t) == pytest.approx(4 / 6)
    assert metrics.f1_binary(p, t) == pytest.approx(2 / 3)
    assert metrics.matthews_corrcoef(p, t) == pytest.approx(1 / 3)
    assert metrics.matthews_corrcoef([1, 1, 1], [0, 1, 1]) == 0.0   # constant prediction
    # Multi-class MCC (sklearn's formula), hand-computed on a 3x3 confusion matrix.
    p3, t3 = [0, 1, 2, 0, 1, 2, 2], [0, 1, 2, 1, 1, 0, 2]
    c = np.zeros((3, 3))
    for a, b in zip(t3, p3):
        c[a, b] += 1
    tk, pk, n, cc = c.sum(1), c.sum(0), c.sum(), np.trace(c)
    ref = (cc * n - tk @ pk) / np.sqrt((n * n - pk @ pk) * (n * n - tk @ tk))
    assert metrics.matthews_corrcoef(p3, t3) == pytest.approx(ref)
    out = metrics.compute(("accuracy", "f1"), p, t)
    assert set(out) == {"accuracy", "f1", "combined_score"}


def test_squad_metric_official_normalisation():
    assert squad.normalize_answer("The  Cat's, hat!") == "cats hat"
    m = squad.squad_metrics(["the Eiffel tower", "in Paris France"], [["Eiffel Tower", "tower"], ["Paris"]])
    assert m["exact_match"] == pytest.approx(50.0)
    # f1: 100 (exact) and 2·(1/3·1)/(1/3+1) = 0.5 -> 75
    assert m["f1"] == pytest.approx(75.0)


# ----------------------------------------------------------------------------- SQuAD windows

def test_squad_windows_and_span_decoding(minilm_dir):
    """The answer sits in the last part of a long context: only later windows hold it; its label
    maps back through the offsets to the exact characters, and decoding the labelled positions of
    one window (other windows proposing worse spans) recovers the original text."""
    tok = load_tokenizer(minilm_dir)
    filler = " ".join(f"Sentence number {w} talks about nothing in particular." for w in
                      ("one", "two", "three", "four", "five", "six"))
    context = filler + " The Rosetta Stone was found in 1799 by French soldiers."
    answer = "French soldiers"
    start = context.index(answer)
    feats = squad.features(tok, ["Who found the Rosetta Stone?"], [context], max_len=32, doc_stride=8,
                           answer_starts=[start], answer_texts=[answer])
    n = len(feats["input_ids"])
    assert n > 2 and feats["input_ids"].shape == (n, 32) and (feats["example_index"] == 0).all()
    labelled = np.flatnonzero(feats["start_positions"] > 0)
    assert labelled.size >= 1 and 0 not in labelled            # the first window lacks the answer
    assert (feats["start_positions"][feats["start_positions"] == 0] == feats["end_positions"][
        feats["start_positions"] == 0]).all()
    f = labelled[-1]
    s, e = feats["start_positions"][f], feats["end_positions"][f]
    assert context[feats["offsets"][f, s, 0]:feats["offsets"][f, e, 1]] == answer
    start_logits = np.random.default_rng(0).normal(size=(n, 32))
    end_logits = np.random.default_rng(1).normal(size=(n, 32))
    start_logits[f, s] = end_logits[f, e] = 10.0
    start_logits[:, 0] = end_logits[:, 0] = 50.0                 # [CLS] is never an answer
    pred = squad.decode(start_logits, end_logits, feats, [context], n_best_size=5, max_answer_length=30)
    assert pred == [answer]
    # A span longer than max_answer_length is refused even with the best logits.
    end_logits[f, e] = -10.0
    end_logits[f, 31 - 1] = 20.0
    pred = squad.decode(start_logits, end_logits, feats, [context], n_best_size=32, max_answer_length=2)
    assert pred[0] != context[feats["offsets"][f, s, 0]:feats["offsets"][f, 30, 1]]


# ----------------------------------------------------------------------------- data

def _write(path, rows, fmt):
    with open(path, "w", newline="") as fh:
        if fmt == "jsonl":
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        else:
            sep = "\t" if fmt == "tsv" else ","
            fh.write(sep.join(rows[0]) + "\n")
            fh.writelines(sep.join(str(v) for v in r.values()) + "\n" for r in rows)


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_readers_and_labels(tmp_path, fmt):
    rows = [{"sentence1": "a cat sat", "sentence2": "a dog ran", "label": "entailment"},
            {"sentence1": "it's \"quoted", "sentence2": "x", "label": "1"}]
    path = tmp_path / f"d.{fmt}"
    _write(path, rows, fmt if fmt != "csv" else "csv")
    if fmt == "csv":   # a CSV quotes a field with a quote in it
        import csv
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    got = data_lib.read_rows(str(path))
    assert [dict(r) for r in got] == rows
    task = tasks.GLUE["rte"]
    np.testing.assert_array_equal(data_lib.label_ids(got, task, "x"), [0, 1])


def test_data_errors_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(data_lib.DataError, match="does not exist.*data.train_file"):
        data_lib.read_rows(str(tmp_path / "nope.jsonl"))
    rows = [{"text": "x", "label": 0}]
    with pytest.raises(data_lib.DataError, match="no column 'sentence'.*text_column"):
        data_lib.check_columns(rows, ["sentence", "label"], "train.jsonl")
    with pytest.raises(data_lib.DataError, match="label 'maybe'.*label_list"):
        data_lib.label_ids([{"label": "maybe"}], tasks.GLUE["sst2"], "f")
    # datasets not installed -> one line: install it, or export to JSONL / pass data.train_file.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(data_lib.DataError, match="pip install datasets.*to_json.*data.train_file"):
        data_lib.read_hf_split("glue", "sst2", "train")
    # Installed but the data is not cached (offline): the same fix.
    fake = types.ModuleType("datasets")

    def load_dataset(*a, **k):
        raise ConnectionError("Couldn't reach 'glue' on the Hub (LocalEntryNotFoundError)")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(data_lib.DataError, match="not in the Hugging Face datasets cache.*data.train_file"):
        data_lib.read_hf_split("glue", "sst2", "train")
    cfg = default_config()
    with pytest.raises(data_lib.DataError, match="data.train_file.*hf_dataset"):
        data_lib.load_split(cfg.data, "train", "train_file")


def test_tasks_table():
    c = default_config()
    for name, kind, pair, metric_names in (("cola", "classification", "", ("matthews_correlation",)),
                                           ("stsb", "regression", "sentence2", ("pearson", "spearmanr")),
                                           ("mrpc", "classification", "sentence2", ("accuracy", "f1"))):
        c.task = name
        t = tasks.get_task(c)
        assert (t.kind, t.text_pair_column, t.metrics) == (kind, pair, metric_names)
    assert tasks.GLUE["mnli"].validation_splits[1] == ("validation_mismatched", "_mm")
    assert tasks.GLUE["stsb"].num_labels == 1 and tasks.GLUE["mnli"].num_labels == 3
    c.task = "nope"
    with pytest.raises(tasks.ConfigError, match="sst2"):
        tasks.get_task(c)


@pytest.mark.parametrize("name", ["finetune.py", "finetune_demo.py"])
def test_shipped_finetune_configs_load_and_validate(name):
    from tacl_jax.finetune.config import validate
    c = load_config_file(os.path.join(ROOT, "configs", name))
    validate(c)
    assert tasks.get_task(c).kind == "classification"
    with pytest.raises(tasks.ConfigError, match="global_batch_size=0: use a value > 0"):
        validate(load_config_file(os.path.join(ROOT, "configs", name), {"global_batch_size": 0}))


def test_batch_order_is_a_pure_function_of_seed_and_step():
    a = [data_lib.train_batch_indices(10, 4, 3, s) for s in range(4)]
    assert sorted(np.concatenate(a[:2]).tolist()) == sorted(set(np.concatenate(a[:2]).tolist()))  # no repeat in an epoch
    np.testing.assert_array_equal(a[3], data_lib.train_batch_indices(10, 4, 3, 3))
    assert not np.array_equal(a[0], a[2])     # a new epoch, a new order


def test_init_from_a_pretraining_workdir_uses_its_export(tmp_path):
    final = tmp_path / "run" / "export" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    (tmp_path / "run" / "checkpoints").mkdir()
    assert train_lib.resolve_init(str(tmp_path / "run"), str(tmp_path / "ft")) == str(final)
    assert train_lib.resolve_init("bert-base-uncased", str(tmp_path / "ft")) == "bert-base-uncased"
    (final / "config.json").unlink()
    with pytest.raises(train_lib.UserError, match="without a checkpoint or export/final"):
        train_lib.resolve_init(str(tmp_path / "run"), str(tmp_path / "ft"))


# ----------------------------------------------------------------------------- runs

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "house", "cloud", "green", "table")


def _toy_task(tmp_path, minilm_dir, n_train=256, n_val=64):
    """A tiny random BERT (MiniLM's vocabulary) as an HF folder, and a learnable task: label 1
    when the sentence holds 'apple'."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    model_dir = tmp_path / "bert"
    transformers.BertModel(cfg).save_pretrained(model_dir)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm_dir, f), model_dir / f)
    rng = np.random.default_rng(0)

    def rows(n):
        out = []
        for i in range(n):
            words = list(rng.choice(WORDS, size=6))
            if i % 2:
                words[rng.integers(6)] = "apple"
            out.append({"text": " ".join(words), "y": "yes" if i % 2 else "no"})
        return out
    for name, n in (("train", n_train), ("val", n_val)):
        _write(tmp_path / f"{name}.jsonl", rows(n), "jsonl")
    return model_dir


def _toy_config(tmp_path, model_dir, **over):
    c = load_config_file(os.path.join(ROOT, "configs", "finetune.py"), {
        "task": "classification", "init.path": str(model_dir), "data.train_file": str(tmp_path / "train.jsonl"),
        "data.validation_file": str(tmp_path / "val.jsonl"), "data.text_column": "text", "data.label_column": "y",
        "max_len": 16, "global_batch_size": 16, "eval_batch_size": 32, "num_train_steps": 40,
        "optim.learning_rate": 3e-3, "log_every": 10, "checkpoint.every": 0, **over})
    return c


@pytest.mark.slow
def test_finetune_learns_and_resume_equals_uninterrupted(tmp_path, minilm_dir):
    model_dir = _toy_task(tmp_path, minilm_dir)
    full = train_lib.finetune(_toy_config(tmp_path, model_dir), str(tmp_path / "full"))
    assert full["eval_accuracy"] >= 0.9, full
    saved = json.loads((tmp_path / "full" / "results.json").read_text())
    assert saved["eval_accuracy"] == full["eval_accuracy"] and "eval_f1" in saved and "eval_loss" in saved
    exported = json.loads((tmp_path / "full" / "export" / "final" / "config.json").read_text())
    assert exported["architectures"] == ["BertForSequenceClassification"]
    assert sorted(exported["id2label"].values()) == ["no", "yes"]
    assert (tmp_path / "full" / "export" / "final" / "tokenizer.json").is_file()
    part = train_lib.finetune(_toy_config(tmp_path, model_dir, steps_per_run=20), str(tmp_path / "split"))
    assert part["status"] == "partial" and part["step"] == 20
    last = train_lib.finetune(_toy_config(tmp_path, model_dir), str(tmp_path / "split"))
    for k in ("eval_loss", "eval_accuracy", "eval_f1"):
        assert last[k] == pytest.approx(full[k], abs=1e-6), k
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    full_rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in full_rows]
    for a, b in zip(rows, full_rows):
        if "loss" in a:
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


@pytest.mark.slow
def test_cli_runs_and_user_errors_are_one_line(tmp_path, minilm_dir):
    model_dir = _toy_task(tmp_path, minilm_dir, n_train=64, n_val=32)
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-m", "tacl_jax.finetune", "--config=configs/finetune.py",
            "--config.task=classification", f"--config.init.path={model_dir}",
            f"--config.data.train_file={tmp_path / 'train.jsonl'}",
            f"--config.data.validation_file={tmp_path / 'val.jsonl'}", "--config.data.text_column=text",
            "--config.data.label_column=y", "--config.max_len=16", "--config.global_batch_size=16",
            "--config.num_train_steps=4", "--config.log_every=2"]
    r = subprocess.run(args + [f"--workdir={tmp_path / 'wd'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| classification | bert | 42 | 4 | " in r.stdout
    assert (tmp_path / "wd" / "results.json").is_file() and (tmp_path / "wd" / "checkpoints" / "4").is_dir()
    bad = subprocess.run(args + ["--config.data.text_column=nope", f"--workdir={tmp_path / 'wd2'}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "no column 'nope'" in bad.stderr


@pytest.mark.slow
def test_finetune_qa_runs_end_to_end(tmp_path, minilm_dir):
    """SQuAD-style rows through windows, training and n-best decoding: the answer (the word after
    'color') is learnable; EM/F1 reported as run_qa.py names them."""
    model_dir = _toy_task(tmp_path, minilm_dir, n_train=16, n_val=16)
    rng = np.random.default_rng(0)
    colors = ("red", "blue", "green", "black")

    def rows(n):
        out = []
        for i in range(n):
            words = list(rng.choice(WORDS, size=20))
            pos = int(rng.integers(0, 18))
            ans = str(rng.choice(colors))
            words[pos:pos + 2] = ["color", ans]
            ctx = " ".join(words)
            out.append({"id": str(i), "question": "which color?", "context": ctx,
                        "answers": {"text": [ans], "answer_start": [ctx.index("color " + ans) + 6]}})
        return out
    _write(tmp_path / "qa_train.jsonl", rows(160), "jsonl")
    _write(tmp_path / "qa_val.jsonl", rows(24), "jsonl")
    c = _toy_config(tmp_path, model_dir, **{"task": "qa", "data.train_file": str(tmp_path / "qa_train.jsonl"),
                                           "data.validation_file": str(tmp_path / "qa_val.jsonl"),
                                           "max_len": 24, "qa.doc_stride": 8, "num_train_steps": 60})
    res = train_lib.finetune(c, str(tmp_path / "qa"))
    assert {"eval_exact_match", "eval_f1", "eval_samples"} <= set(res)
    assert res["eval_samples"] == 24 and res["eval_exact_match"] >= 50.0, res
