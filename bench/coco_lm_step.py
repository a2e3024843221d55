"""COCO-LM train-step throughput and MFU; prints one JSON object (the COCO-LM row).

    python bench/coco_lm_step.py                              # small, bf16
    python bench/coco_lm_step.py --size=small --precision=fp32 --steps=10 --warmup=2

The step is the training loop's: ``tacl_jax.train.setup.build_program``'s jitted COCO-LM step
(``coco_step.make_coco_train_step``, jitted with shardings, the state donated) on one CPU device,
the state from ``Program.create_state``, on BERT's synthetic batches (``[CLS] A [SEP] B [SEP]``,
10% short rows, bert-base-uncased ids). The recipe is ``configs/coco_lm_base.py``'s (its loss,
masking and Adam (0.9, 0.98), eps 1e-6, lr 5e-4, weight decay 0.01, clip 2.0) with one warm-up
step, no accumulation and SCL groups of at most the batch. Sizes as ``bench/step_throughput.py``
(``small`` = 4 layers, hidden 256, 4 heads, ffn 1024, L = 128, batch 16); generator
``--generator_layers`` (default 2: the released COCO-LM small's).
``tokens_per_s = batch · seq · timed_steps / Σ step time`` (padding included).

MFU. Model FLOPs of a step = the program's ``flops_per_step`` (``coco_step.coco_step_flops``): the generator's forward
and backward (3×) plus its no-dropout sampling forward, each with the MLM head on the P gathered
slots; the main model's forward and backward on the corrupted *and* the cropped views (2 × L
tokens per sequence), with the tied CLM decoder on the P slots. The peak is measured in the same
run (a jitted 2048³ dot, f32 and bf16-in/f32-accumulate, best of 5), and the table's vendor peak
(``tacl_jax.flops.PEAK_FLOPS``) is used too when the device is in it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_throughput import PRECISIONS, SIZES, VOCAB, synthetic_batches, worker_matmul  # noqa: E402  pylint: disable=wrong-import-position


def coco_lm_config(size: str = "small", precision: str = "bf16", steps: int = 10, warmup: int = 2,
                   generator_layers: int = 2):
    """``configs/coco_lm_base.py`` at ``size``: the bench's run config."""
    from tacl_jax.config import load_config_file

    sz = SIZES[size]
    c = load_config_file(os.path.join(REPO, "configs", "coco_lm_base.py"))
    c.coco_lm.generator_layers = generator_layers
    c.init.scratch.update(vocab_size=VOCAB, hidden_size=sz["hidden"], num_hidden_layers=sz["layers"],
                          num_attention_heads=sz["heads"], intermediate_size=sz["intermediate"],
                          max_position_embeddings=512)
    c.max_len, c.global_batch_size, c.grad_accum_steps = sz["seq"], sz["batch"], 1
    c.coco_lm.scl_group_size = min(c.coco_lm.scl_group_size, sz["batch"])   # base's batch 8 < the recipe's 16
    c.num_train_steps = warmup + steps
    c.optim.warmup_steps = 1
    c.model.dtype = PRECISIONS[precision]
    return c


def coco_lm_row(size: str = "small", precision: str = "bf16", steps: int = 10, warmup: int = 2,
                generator_layers: int = 2) -> dict:
    """Build, compile and time the COCO-LM step; the row as a dict."""
    import flax.linen as nn
    import jax

    from tacl_jax import tokens
    from tacl_jax.train import setup

    sz = SIZES[size]
    c = coco_lm_config(size, precision, steps, warmup, generator_layers)
    t0 = time.perf_counter()
    prog = setup.build_program(c, jax.devices()[:1], special_ids=tokens.default_special_ids(VOCAB))
    state = prog.create_state()
    batches = synthetic_batches(prog)
    rng = jax.random.key(c.seed)
    build_s = time.perf_counter() - t0

    with jax.set_mesh(prog.mesh), nn.logical_axis_rules(prog.rules):
        t0 = time.perf_counter()
        compiled = prog.train_step.lower(state, None, batches[0], rng).compile()
        compile_s = time.perf_counter() - t0
        times, hist = [], []
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            state, metrics = compiled(state, None, batch, rng)
            jax.block_until_ready((state, metrics))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            hist.append({k: float(v) for k, v in jax.device_get(metrics).items()})

    tok = sz["batch"] * sz["seq"]
    tps = tok * len(times) / sum(times)
    step_flops = prog.flops_per_step
    achieved = step_flops / statistics.median(times)
    peaks = _matmul_peaks()
    row = dict(bench="coco_lm_step", impl="tacl_jax", size=size, precision=precision,
               generator_layers=generator_layers, device=jax.devices()[0].device_kind,
               tokens_per_s=tps, step_ms_median=1000 * statistics.median(times),
               step_ms_all=[round(1000 * t, 1) for t in times], compile_s=compile_s, build_s=build_s,
               model_flops_per_step=step_flops, model_flops_per_token=step_flops / tok,
               model_gflops=achieved / 1e9, matmul_f32_gflops=peaks["f32"] / 1e9,
               matmul_bf16_gflops=peaks["bf16"] / 1e9, mfu_of_f32_peak=achieved / peaks["f32"],
               mfu_of_bf16_peak=achieved / peaks["bf16"])
    table = prog.peak_flops_per_device   # tacl_jax.flops.PEAK_FLOPS by device kind
    if table:
        row["mfu"] = achieved / table
    for k in ("loss", "gen_mlm_loss", "binary_loss", "binary_acc", "clm_loss", "scl_loss", "replaced_frac"):
        row[f"{k}_first"], row[f"{k}_last"] = hist[0][k], hist[-1][k]
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def _matmul_peaks(n: int = 2048, reps: int = 5) -> dict[str, float]:
    """Best-of-``reps`` FLOP/s of a jitted n³ dot, f32 and bf16 inputs with f32 accumulation
    (``step_throughput``'s measurement)."""
    res = worker_matmul(argparse.Namespace(matmul_n=n, matmul_reps=reps))
    return {name: res[f"{name}_gflops_best"] * 1e9 for name in ("f32", "bf16")}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--precision", default="bf16", choices=sorted(PRECISIONS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--generator_layers", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    row = coco_lm_row(args.size, args.precision, args.steps, args.warmup, args.generator_layers)
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
