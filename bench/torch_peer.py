#!/usr/bin/env python3
"""The effect study's PyTorch peer: TaCL with the original's arithmetic, and its measures.

Independent of tacl_jax (torch + transformers only), so that a claim of ``bench/tacl_effect.py``
about TaCL's effect can be set beside the same run in another implementation. From an
MLM-trained BERT folder (student init = frozen teacher), trains ``--objective`` (mlm, tacl, or
init: no training) on rows of ``--train`` and measures the student on sentences of ``--heldout``.
Prints JSON lines; the last is the result.

Training, as the authors' ``bert_contrastive.py`` computes it:
  rows       the text's sub-word ids cut into full rows of ``--seq`` ([CLS] ids [SEP]; no [PAD]);
             each step ``--batch`` rows drawn at random with replacement
  masking    each non-special token selected with probability 0.15, of those 80% → [MASK], 10% →
             a random id ≥ 999, 10% kept (redrawn every step)
  MLM        cross-entropy at the selected positions (weight ``--mlm_weight``; 0 = TaCL only)
  TaCL       cosine(student's last layer on the masked row, frozen teacher's on the plain row) / τ
             against every position of the same row; the positive is the same position; averaged
             over the anchors: the selected positions, or every position (``--anchors=all``)
  teacher    deterministic, or with its dropout on (``--teacher_dropout``: the authors' code)
  optimiser  AdamW (eps 1e-6, no weight decay), ``--lr`` after 10% linear warm-up, linear decay to
             0, gradient clipping at 1.0; fp32
  device     ``--device`` (cpu, or cuda for a GPU; fp32 there too, TF32 off, torch's default): rows
             and masks are drawn on the CPU from the same generator either way, so a seed picks the
             same rows and masks on every device
There is no [PAD] in these rows, so the question of masking [PAD] keys does not arise here.

Measures (per layer, 0 = embeddings; ``--sentences`` held-out sentences of ≥ 5 words as
``[CLS] sentence [SEP]``, one at a time, eval mode, a sample fixed by ``--sentence_seed``):
  self_similarity                mean cosine over the token pairs i < j of a sentence,
                                 micro-averaged over the sentences (the paper's statistic)
  masked_anchor_self_similarity  the same over the pairs of anchors only, on the sentence masked
                                 as in training (fixed generator ``--sentence_seed``): the states
                                 TaCL's loss acts on
  cosine_to_teacher              cosine of student and teacher at the same token, plain input
  anchor_cosine_to_teacher       student on the masked input vs teacher on the plain, at the anchors
``--measure_every N`` also measures the student every N steps (``trajectory``); measuring draws
nothing from the training's random streams, so the end result is the same with or without it.

Long runs (hours on a CPU): ``--checkpoint FILE`` saves the whole run state (student, AdamW,
schedule, the row/mask generator, the dropout RNG, the trajectory so far) every
``--checkpoint_every`` steps, atomically; a run that finds FILE resumes from it and ends bit-equal
to an uninterrupted one (a FILE written with other settings is refused). ``--stop_after N`` stops
after step N of the ``--steps`` schedule, saves, and reports the student there (``stopped_at``),
so a long schedule can be run in pieces.

  python bench/torch_peer.py --init DIR --train stage2.txt --heldout test.txt --objective tacl --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, BertForMaskedLM, BertModel

MASK_PROB = 0.15
FIRST_RANDOM_ID = 999     # BERT's vocab: ids below are [PAD], [unused*], [UNK], [CLS], [SEP], [MASK]


def train_rows(path: str, tok, seq: int) -> torch.Tensor:
    """``[N, seq]`` rows: the file's sub-word ids in order, cut into ``seq − 2`` pieces, each
    wrapped in [CLS] … [SEP]; the ragged tail is dropped."""
    with open(path, encoding="utf-8") as f:
        ids = tok(f.read(), add_special_tokens=False)["input_ids"]
    body = seq - 2
    starts = range(0, len(ids) - body, body)
    return torch.tensor([[tok.cls_token_id, *ids[s:s + body], tok.sep_token_id] for s in starts], dtype=torch.long)


def bert_mask(x: torch.Tensor, tok, g: torch.Generator):
    """BERT's masking of ``x [B, L]``: ``(masked input, selected [B, L] bool)``; draws from ``g``
    in a fixed order (selection, replacement kind, random ids)."""
    specials = torch.tensor([tok.cls_token_id, tok.sep_token_id, tok.pad_token_id])
    selected = (torch.rand(x.shape, generator=g) < MASK_PROB) & ~torch.isin(x, specials)
    kind = torch.rand(x.shape, generator=g)
    out = x.clone()
    out[selected & (kind < 0.8)] = tok.mask_token_id
    swap = selected & (kind >= 0.8) & (kind < 0.9)
    out[swap] = torch.randint(FIRST_RANDOM_ID, tok.vocab_size, (int(swap.sum()),), generator=g)
    return out, selected


def contrastive_nll(student_last: torch.Tensor, teacher_last: torch.Tensor, tau: float) -> torch.Tensor:
    """``[B·L]`` TaCL loss per position: −log softmax_j(cos(s_i, t_j) / τ) at j = i, over the
    positions j of the same row. ``student_last``/``teacher_last``: ``[B, L, H]``."""
    b, length, _ = student_last.shape
    scores = torch.einsum("bid,bjd->bij", F.normalize(student_last, dim=-1), F.normalize(teacher_last, dim=-1)) / tau
    target = torch.arange(length, device=scores.device).expand(b, -1)
    return F.cross_entropy(scores.reshape(-1, length), target.reshape(-1), reduction="none")


def heldout_sentences(path: str, n: int, seed: int) -> list[str]:
    """``n`` sentences of ≥ 5 words from a wikitext file (headings skipped, lines cut at " . "),
    shuffled with ``seed``."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip() and not line.strip().startswith("=")]
    sentences = [s.strip() + " ." for line in lines for s in re.split(r" \. ", line) if len(s.split()) >= 5]
    random.Random(seed).shuffle(sentences)
    return sentences[:n]


def _pair_sum(u: torch.Tensor) -> float:
    """Σ over pairs i < j of the cosines of unit rows ``u [n, H]``."""
    c = u @ u.T
    iu = torch.triu_indices(c.shape[0], c.shape[0], 1, device=c.device)
    return float(c[iu[0], iu[1]].sum())


@torch.no_grad()
def measure(student: BertModel, teacher: BertModel, tok, sentences: list[str], mask_seed: int) -> dict:
    """The module doc's measures of ``student`` beside ``teacher``: name -> per-layer list."""
    was_training = student.training
    student.eval()
    g = torch.Generator().manual_seed(mask_seed)
    dev = next(student.parameters()).device
    n_layers = student.config.num_hidden_layers + 1
    sums = {k: [0.0] * n_layers for k in ("pairs", "anchor_pairs", "cos", "anchor_cos")}
    counts = dict(pairs=0, anchor_pairs=0, tokens=0, anchors=0)
    for s in sentences:
        enc = tok(s, return_tensors="pt", truncation=True, max_length=128)
        masked, sel = bert_mask(enc["input_ids"], tok, g)   # on the CPU, as in training
        enc, masked, sel = {k: v.to(dev) for k, v in enc.items()}, masked.to(dev), sel.to(dev)
        x = enc["input_ids"]
        plain = student(**enc, output_hidden_states=True).hidden_states
        on_masked = student(input_ids=masked, attention_mask=enc["attention_mask"], output_hidden_states=True).hidden_states
        ref = teacher(**enc, output_hidden_states=True).hidden_states
        anchors = sel[0]
        for layer in range(n_layers):
            h = F.normalize(plain[layer][0], dim=-1)
            hm = F.normalize(on_masked[layer][0], dim=-1)
            t = F.normalize(ref[layer][0], dim=-1)
            sums["pairs"][layer] += _pair_sum(h)
            sums["cos"][layer] += float((h * t).sum())
            if anchors.any():
                sums["anchor_pairs"][layer] += _pair_sum(hm[anchors])
                sums["anchor_cos"][layer] += float((hm[anchors] * t[anchors]).sum())
        n, n_anchors = x.shape[1], int(anchors.sum())
        counts["pairs"] += n * (n - 1) // 2
        counts["anchor_pairs"] += n_anchors * (n_anchors - 1) // 2
        counts["tokens"] += n
        counts["anchors"] += n_anchors
    student.train(was_training)
    return dict(
        self_similarity=[v / counts["pairs"] for v in sums["pairs"]],
        masked_anchor_self_similarity=[v / max(counts["anchor_pairs"], 1) for v in sums["anchor_pairs"]],
        cosine_to_teacher=[v / counts["tokens"] for v in sums["cos"]],
        anchor_cosine_to_teacher=[v / max(counts["anchors"], 1) for v in sums["anchor_cos"]],
        sentences=len(sentences), anchors=counts["anchors"])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, help="an MLM-trained BERT folder (student init and teacher)")
    ap.add_argument("--train", help="text file of the training rows (not needed for --objective=init)")
    ap.add_argument("--heldout", required=True, help="wikitext file of the measured sentences")
    ap.add_argument("--objective", choices=["mlm", "tacl", "init"], default="tacl")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tau", type=float, default=0.01)
    ap.add_argument("--mlm_weight", type=float, default=1.0, help="0: TaCL alone")
    ap.add_argument("--anchors", choices=["masked", "all"], default="masked")
    ap.add_argument("--teacher_dropout", action="store_true", help="the teacher in train mode (the authors' code)")
    ap.add_argument("--seed", type=int, default=0, help="rows, masks, dropout")
    ap.add_argument("--sentences", type=int, default=500)
    ap.add_argument("--sentence_seed", type=int, default=1234, help="the measured sentences and their masks")
    ap.add_argument("--measure_every", type=int, default=0, help="also measure every N steps (trajectory)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="torch device: cpu, or cuda (cuda:N) for a GPU")
    ap.add_argument("--checkpoint", help="a file: the run state, saved every --checkpoint_every steps; resumed from")
    ap.add_argument("--checkpoint_every", type=int, default=250)
    ap.add_argument("--stop_after", type=int, default=0,
                    help="stop after this step of the --steps schedule (saved to --checkpoint; resumable)")
    a = ap.parse_args(argv)
    if a.stop_after and not 0 < a.stop_after < a.steps:
        ap.error(f"--stop_after={a.stop_after} must lie inside the schedule, 0 < N < --steps={a.steps}")
    if a.checkpoint_every < 1:
        ap.error(f"--checkpoint_every={a.checkpoint_every} must be a positive number of steps")
    if a.objective != "init" and not a.train:
        ap.error(f"--objective={a.objective} trains: pass --train=<text file>")
    if a.device.split(":")[0] not in ("cpu", "cuda"):
        ap.error(f"--device={a.device}: use cpu, or cuda (cuda:N) for an NVIDIA GPU")
    if a.objective == "mlm" and (a.mlm_weight != 1.0 or a.anchors != "masked" or a.teacher_dropout):
        ap.error("--mlm_weight, --anchors and --teacher_dropout are TaCL's options: use --objective=tacl")
    return a


def check_paths(a: argparse.Namespace) -> None:
    """A clear error for a missing init folder or text file (before transformers' own)."""
    if not os.path.isfile(os.path.join(a.init, "config.json")):
        raise SystemExit(f"torch_peer.py: --init={a.init} is not a Hugging Face BERT folder (no config.json): "
                         f"pass an MLM-trained export, e.g. bench/tacl_effect.py's <out>/stage1/export/final")
    for flag, path in (("--heldout", a.heldout), ("--train", a.train)):
        if path and not os.path.isfile(path):
            raise SystemExit(f"torch_peer.py: {flag}={path}: no such file")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"torch_peer.py: --device={a.device} but this torch sees no CUDA GPU "
                         f"(torch {torch.__version__}): run with --device=cpu, or on a machine with a GPU "
                         f"and a CUDA build of torch")


# The settings a checkpoint must share with the run that resumes it (the rest: threads, device,
# logging; a run resumed on another device goes on from the same state, not bit-equal).
RUN_KEYS = ("init", "train", "objective", "steps", "batch", "seq", "lr", "tau", "mlm_weight", "anchors",
            "teacher_dropout", "seed", "sentences", "sentence_seed", "measure_every")


def run_settings(a: argparse.Namespace) -> dict:
    """The flags a checkpoint records and a resuming run must repeat (``RUN_KEYS``)."""
    return {k: getattr(a, k) for k in RUN_KEYS}


def save_state(path: str, a: argparse.Namespace, done: int, train_s: float, res: dict, student, opt, sched,
               g: torch.Generator) -> None:
    """The run after step ``done``, written to a temporary file and renamed (a crash mid-write
    leaves the previous checkpoint whole)."""
    state = dict(settings=run_settings(a), done=done, train_s=train_s, res=res,
                 student=student.state_dict(), opt=opt.state_dict(), sched=sched.state_dict(),
                 rows_rng=g.get_state(), torch_rng=torch.get_rng_state(),
                 cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: str, a: argparse.Namespace, student, opt, sched, g: torch.Generator) -> tuple[int, float, dict]:
    """Restores a ``save_state`` file into the run; ``(steps done, train seconds, result so far)``."""
    state = torch.load(path, weights_only=False)
    differ = {k: (state["settings"].get(k), v) for k, v in run_settings(a).items() if state["settings"].get(k) != v}
    if differ:
        raise SystemExit(f"torch_peer.py: --checkpoint={path} belongs to a run with other settings "
                         f"({', '.join(f'{k}: saved {s!r}, now {n!r}' for k, (s, n) in differ.items())}): "
                         f"pass the same flags to resume it, or another --checkpoint to start afresh")
    student.load_state_dict(state["student"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    g.set_state(state["rows_rng"])
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():   # the dropout streams on a GPU
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["done"], state["train_s"], state["res"]


def main(argv=None) -> dict:
    a = parse_args(argv)
    check_paths(a)

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.init)
    dev = torch.device(a.device)
    # fp32 whatever the checkpoint's dtype (transformers 5 would keep a half-precision file's)
    student = BertForMaskedLM.from_pretrained(a.init, dtype=torch.float32).to(dev)
    teacher = BertModel.from_pretrained(a.init, add_pooling_layer=False, dtype=torch.float32).to(dev).eval()
    teacher.requires_grad_(False)
    sentences = heldout_sentences(a.heldout, a.sentences, a.sentence_seed)
    res = {k: getattr(a, k) for k in ("objective", "seed", "steps", "tau", "mlm_weight", "anchors", "teacher_dropout")}
    if a.objective != "init":
        res["trajectory"] = {}
        rows = train_rows(a.train, tok, a.seq)
        g = torch.Generator().manual_seed(a.seed)
        opt = torch.optim.AdamW(student.parameters(), lr=a.lr, eps=1e-6, weight_decay=0.0)
        warm = max(1, a.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: s / warm if s < warm else max(0.0, (a.steps - s) / max(1, a.steps - warm)))
        start, train_s = 0, 0.0
        if a.checkpoint and os.path.isfile(a.checkpoint):
            start, train_s, res = load_state(a.checkpoint, a, student, opt, sched, g)
            res["resumed_from"] = start
            print(json.dumps({"resumed_from": start}), flush=True)
        end = a.stop_after or a.steps
        student.train()
        t0 = time.time()
        for step in range(start, end):
            x = rows[torch.randint(0, rows.shape[0], (a.batch,), generator=g)]
            inp, sel = bert_mask(x, tok, g)          # on the CPU, from g, whatever the device
            x, inp, sel = x.to(dev), inp.to(dev), sel.to(dev)
            out = student(input_ids=inp, output_hidden_states=True)
            mlm = F.cross_entropy(out.logits.view(-1, out.logits.shape[-1]), x.masked_fill(~sel, -100).view(-1),
                                  ignore_index=-100)
            loss = mlm
            if a.objective == "tacl":
                teacher.train(a.teacher_dropout)
                with torch.no_grad():
                    t = teacher(input_ids=x).last_hidden_state
                nll = contrastive_nll(out.hidden_states[-1], t, a.tau)
                anchors = (sel if a.anchors == "masked" else torch.ones_like(sel)).reshape(-1).float()
                tacl = (nll * anchors).sum() / anchors.sum().clamp(min=1)
                # 1.0 × mlm is mlm to the bit; weight 0 leaves MLM out of the graph entirely
                loss = tacl if a.mlm_weight == 0 else (mlm if a.mlm_weight == 1.0 else a.mlm_weight * mlm) + tacl
                res["tacl_loss_last"] = tacl.item()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            sched.step()
            res["mlm_loss_last"] = mlm.item()
            if step % 100 == 0:
                print(json.dumps({"step": step, "loss": loss.item(), "mlm": mlm.item()}), flush=True)
            done = step + 1
            if a.measure_every and done % a.measure_every == 0 and done < a.steps:
                teacher.eval()
                res["trajectory"][str(done)] = measure(student.bert, teacher, tok, sentences, a.sentence_seed)
                # the whole measure, so that a log shows the trajectory of a run still going
                print(json.dumps({"step": done, "self_similarity@last": res["trajectory"][str(done)]["self_similarity"][-1],
                                  "measure": res["trajectory"][str(done)]}), flush=True)
            if a.checkpoint and done < a.steps and (done % a.checkpoint_every == 0 or done == end):
                save_state(a.checkpoint, a, done, train_s + time.time() - t0, res, student, opt, sched, g)
        res["train_s"] = round(train_s + time.time() - t0, 1)
        if end < a.steps:
            res["stopped_at"] = end
    teacher.eval()
    res.update(measure(student.bert, teacher, tok, sentences, a.sentence_seed))
    res["last_layer_self_similarity"] = res["self_similarity"][-1]
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
