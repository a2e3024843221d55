"""bench/torch_peer.py (the effect study's PyTorch peer) against naive numpy loops on a tiny BERT:
its TaCL loss, its masking, its per-layer measures, and that measuring mid-run changes nothing."""

import os
import shutil

import numpy as np
import pytest
from bench_module import load_bench

torch = pytest.importorskip("torch")  # in the test extras; never skipped in CI
transformers = pytest.importorskip("transformers")

TEXT = ("The tower is 324 metres tall , about the same height as an 81 @-@ storey building . "
        "It was the first structure to reach a height of 300 metres . Its base is square , measuring "
        "125 metres on each side . During its construction , it surpassed the Washington Monument . ")


def copy_tokenizer(src, *dsts):
    """The tokenizer files of the BERT folder ``src`` into each folder of ``dsts``."""
    for name in os.listdir(src):
        if name.startswith(("vocab", "tokenizer", "special_tokens")):
            for dst in dsts:
                shutil.copy(os.path.join(src, name), dst)


@pytest.fixture(scope="module")
def peer():
    return load_bench("torch_peer")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, minilm_dir):
    """A random 2-layer BERT with an MLM head and MiniLM's uncased tokenizer, saved as a folder."""
    folder = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128)
    transformers.BertForMaskedLM(cfg).save_pretrained(folder)
    copy_tokenizer(minilm_dir, folder)
    heldout = folder / "heldout.txt"
    heldout.write_text(" = Tower = \n\n" + TEXT * 2 + "\n")
    train = folder / "train.txt"
    train.write_text(TEXT * 20)
    return dict(init=str(folder), heldout=str(heldout), train=str(train))


def test_contrastive_nll_matches_a_loop(peer):
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    got = peer.contrastive_nll(torch.tensor(s), torch.tensor(t), 0.05).numpy().reshape(2, 5)
    for b in range(2):
        for i in range(5):
            scores = [s[b, i] @ t[b, j] / np.linalg.norm(s[b, i]) / np.linalg.norm(t[b, j]) / 0.05 for j in range(5)]
            want = -(scores[i] - np.log(np.sum(np.exp(scores))))
            assert got[b, i] == pytest.approx(want, rel=1e-9)


def test_masking_keeps_specials_and_splits_80_10_10(peer, tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["init"])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1000, tok.vocab_size, (400, 64), generator=g)
    x[:, 0], x[:, -1], x[:5, 30:] = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id
    out, sel = peer.bert_mask(x, tok, g)
    assert not sel[:, 0].any() and not sel[:, -1].any() and not sel[:5, 30:].any()
    assert torch.equal(out[~sel], x[~sel])                       # only selected tokens change
    candidates = ~torch.isin(x, torch.tensor([tok.cls_token_id, tok.sep_token_id, tok.pad_token_id]))
    assert sel.sum().item() / candidates.sum().item() == pytest.approx(0.15, abs=0.005)
    masked = (out[sel] == tok.mask_token_id).float().mean().item()
    kept = (out[sel] == x[sel]).float().mean().item()
    assert masked == pytest.approx(0.8, abs=0.02) and kept == pytest.approx(0.1, abs=0.015)
    swapped = out[sel & (out != tok.mask_token_id)]
    assert (swapped >= peer.FIRST_RANDOM_ID).all()              # random ids skip [PAD]/[unused]/[CLS]…


def test_measures_match_a_naive_loop(peer, tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["init"])
    torch.manual_seed(1)
    student = transformers.BertModel.from_pretrained(tiny["init"], add_pooling_layer=False)
    with torch.no_grad():        # a student that differs from its teacher
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    teacher = transformers.BertModel.from_pretrained(tiny["init"], add_pooling_layer=False).eval()
    sentences = peer.heldout_sentences(tiny["heldout"], 6, seed=3)
    assert len(sentences) == 6 and all(len(s.split()) >= 5 for s in sentences)
    student.train()
    got = peer.measure(student, teacher, tok, sentences, mask_seed=7)
    assert student.training                        # measured in eval mode, then given back as it was
    assert peer.measure(student, teacher, tok, sentences, mask_seed=7) == got     # dropout off: deterministic
    student.eval()

    g = torch.Generator().manual_seed(7)           # the same anchors, drawn in the same order
    sums = np.zeros((4, 3))
    counts = np.zeros(4)
    with torch.no_grad():
        for sent in sentences:
            enc = tok(sent, return_tensors="pt")
            masked, sel = peer.bert_mask(enc["input_ids"], tok, g)
            hs = [h[0].double().numpy() for h in student(**enc, output_hidden_states=True).hidden_states]
            hm = [h[0].double().numpy() for h in student(input_ids=masked, output_hidden_states=True).hidden_states]
            ht = [h[0].double().numpy() for h in teacher(**enc, output_hidden_states=True).hidden_states]
            a = np.flatnonzero(sel[0].numpy())
            n = len(hs[0])
            for layer in range(3):
                cos = lambda u, v: u @ v / np.linalg.norm(u) / np.linalg.norm(v)
                sums[0, layer] += sum(cos(hs[layer][i], hs[layer][j]) for i in range(n) for j in range(i + 1, n))
                sums[1, layer] += sum(cos(hm[layer][i], hm[layer][j]) for i in a for j in a if i < j)
                sums[2, layer] += sum(cos(hs[layer][i], ht[layer][i]) for i in range(n))
                sums[3, layer] += sum(cos(hm[layer][i], ht[layer][i]) for i in a)
            counts += [n * (n - 1) / 2, len(a) * (len(a) - 1) / 2, n, len(a)]
    assert counts[3] > 0
    for k, name in enumerate(("self_similarity", "masked_anchor_self_similarity", "cosine_to_teacher",
                              "anchor_cosine_to_teacher")):
        np.testing.assert_allclose(got[name], sums[k] / counts[k], rtol=1e-5, atol=1e-6, err_msg=name)


def _run(peer, tiny, *extra):
    return peer.main(["--init", tiny["init"], "--train", tiny["train"], "--heldout", tiny["heldout"], "--steps", "4",
                      "--batch", "2", "--seq", "16", "--sentences", "4", "--threads", "1", *extra])


def test_measuring_mid_run_changes_nothing_and_the_arms_differ(peer, tiny):
    plain = _run(peer, tiny, "--objective", "tacl")
    traced = _run(peer, tiny, "--objective", "tacl", "--measure_every", "2")
    assert list(traced["trajectory"]) == ["2"] and plain["trajectory"] == {}
    for k in ("self_similarity", "masked_anchor_self_similarity", "tacl_loss_last", "mlm_loss_last"):
        assert traced[k] == plain[k], k
    # each arm's flag reaches the step: its loss after 4 steps is not the plain TaCL arm's
    for flags in (["--mlm_weight", "0"], ["--anchors", "all"], ["--teacher_dropout"], ["--tau", "0.1"]):
        other = _run(peer, tiny, "--objective", "tacl", *flags)
        assert other["tacl_loss_last"] != plain["tacl_loss_last"], flags
    with pytest.raises(SystemExit):
        _run(peer, tiny, "--objective", "mlm", "--anchors", "all")     # a TaCL option on the MLM arm


def test_bad_paths_are_named(peer, tiny, tmp_path):
    with pytest.raises(SystemExit, match="not a Hugging Face BERT folder"):
        peer.main(["--init", str(tmp_path), "--heldout", tiny["heldout"], "--objective", "init"])
    with pytest.raises(SystemExit, match="--train=.*nope.txt: no such file"):
        peer.main(["--init", tiny["init"], "--heldout", tiny["heldout"], "--train", str(tmp_path / "nope.txt")])


def test_bad_devices_are_named(peer, tiny, monkeypatch):
    with pytest.raises(SystemExit):
        peer.parse_args(["--init", tiny["init"], "--heldout", tiny["heldout"], "--device", "mps"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device=cuda but this torch sees no CUDA GPU.*--device=cpu"):
        peer.main(["--init", tiny["init"], "--heldout", tiny["heldout"], "--objective", "init", "--device", "cuda"])


def test_a_half_precision_init_is_measured_in_fp32(peer, tiny, tmp_path):
    """An fp16 copy of the init (e.g. one shipped at half the size) gives the measures of its values
    in fp32: the same as the fp32 folder holding those very values."""
    half, back = tmp_path / "half", tmp_path / "back"
    model = transformers.BertForMaskedLM.from_pretrained(tiny["init"])
    model.half().save_pretrained(half)
    model.float().save_pretrained(back)           # fp32 with the fp16-rounded values
    copy_tokenizer(tiny["init"], half, back)
    flags = ["--heldout", tiny["heldout"], "--objective", "init", "--sentences", "3"]
    a, b = peer.main(["--init", str(half), *flags]), peer.main(["--init", str(back), *flags])
    np.testing.assert_allclose(a["self_similarity"], b["self_similarity"], rtol=0, atol=1e-6)


def test_a_resumed_run_ends_bit_equal_to_an_uninterrupted_one(peer, tiny, tmp_path):
    """Stopped after step 2 of 4 (the checkpoint saved), then resumed: the same student as one
    run of 4 steps; teacher dropout on, so the dropout RNG's state must travel too."""
    flags = ["--objective", "tacl", "--teacher_dropout", "--measure_every", "1"]
    whole = _run(peer, tiny, *flags)
    ckpt = str(tmp_path / "peer.ckpt")
    first = _run(peer, tiny, *flags, "--checkpoint", ckpt, "--checkpoint_every", "3", "--stop_after", "2")
    assert first["stopped_at"] == 2 and list(first["trajectory"]) == ["1", "2"]
    assert first["self_similarity"] == whole["trajectory"]["2"]["self_similarity"]   # measured where it stopped
    rest = _run(peer, tiny, *flags, "--checkpoint", ckpt, "--checkpoint_every", "3")
    assert rest["resumed_from"] == 2 and "stopped_at" not in rest
    assert rest["trajectory"] == whole["trajectory"]
    for k in ("self_similarity", "masked_anchor_self_similarity", "cosine_to_teacher", "tacl_loss_last",
              "mlm_loss_last"):
        assert rest[k] == whole[k], k
    with pytest.raises(SystemExit, match=r"other settings \(tau: saved 0.01, now 0.1\).*another --checkpoint"):
        _run(peer, tiny, *flags, "--checkpoint", ckpt, "--tau", "0.1")
    with pytest.raises(SystemExit):
        _run(peer, tiny, "--objective", "tacl", "--stop_after", "4")            # outside the 4-step schedule


def test_the_study_runs_the_peer_resumably_and_logs_it(peer, tiny, tmp_path):
    """bench/tacl_effect.py's peer arm: a subprocess of bench/torch_peer.py with a checkpoint in
    the seed's folder (deleted when the arm finishes) and a log; its result is the peer's own."""
    import sys
    tacl_effect = load_bench("tacl_effect")
    args = tacl_effect.parse_args(["--out", str(tmp_path), "--init", tiny["init"], "--steps", "4", "--batch", "2",
                                   "--max_len", "16", "--sentences", "4", "--heldout", tiny["heldout"],
                                   "--checkpoint_every", "2", "--peer_threads", "1", "--peer"])
    args.train, args.seed = tiny["train"], 0
    assert args.peer_python == sys.executable
    cmd = tacl_effect.peer_command(args, "teacher_dropout", str(tmp_path / "c.ckpt"))
    parsed = peer.parse_args(cmd[2:])
    assert (parsed.checkpoint, parsed.checkpoint_every, parsed.threads, parsed.teacher_dropout) == (
        str(tmp_path / "c.ckpt"), 2, 1, True)
    got = tacl_effect.run_peer(args, "tacl", str(tmp_path))
    want = _run(peer, tiny, "--objective", "tacl", "--seed", "0")
    assert got["self_similarity"] == want["self_similarity"] and got["tacl_loss_last"] == want["tacl_loss_last"]
    assert "--checkpoint" in got["command"] and not (tmp_path / "peer_tacl.ckpt").exists()
    assert (tmp_path / "peer_tacl.log").read_text().strip().endswith("}")
