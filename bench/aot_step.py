#!/usr/bin/env python3
"""Compiler figures of the train step for every hardware preset on its topology, and of the Hugging
Face Flax peer's step on the same devices: one JSON object.

    python bench/aot_step.py [--pairs=base@v4-8,tpu_v5e_16@v5e-16] [--peer_python=PY] [--out=FILE]

Each pair ``CONFIG@TOPOLOGY`` is ``python -m tacl_jax.aot --config=configs/CONFIG.py
--topology=TOPOLOGY --json=...`` in a fresh process, one at a time (a base-size compile holds
~10 GB on the host). Nothing runs on an accelerator: memory, FLOPs, collectives and relayout bytes
are what XLA compiled, and step times are **estimates** (XLA:TPU's per-instruction cycle
estimates summed, ``tacl_jax.hlo``), comparable between programs on the same topology only.

The peer (``--peer_python``: an environment with transformers 4.x, whose Flax classes 5.x
dropped, and the same jax with libtpu) is the arithmetic of ``../shared/bench/hf_flax_tacl.py
--head mlm``: ``FlaxBertForMaskedLM`` student and ``FlaxBertModel`` teacher in bf16 compute,
logits at every position, the contrastive loss over each sequence's teacher states, optax clip +
AdamW, one jit with params and optimizer state donated, data-parallel over the same devices
(params replicated, batch split). Its program goes through the same estimator, so the ratio
``peer est. step / ours`` compares like with like. Pairs whose config is a TaCL bert-base step get
a peer row at the same batch and length.

``--worker=peer`` is the peer's compile (run by the driver under ``--peer_python``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PAIRS = "base@v4-8,tpu_v4_8@v4-8,tpu_v5e_16@v5e-16,coco_lm_base@v4-8"


def run_ours(config: str, topology: str, extra: list[str], timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tacl_jax.aot", f"--config={REPO}/configs/{config}.py",
                               f"--topology={topology}", f"--json={out}", *extra],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        if not os.path.exists(out):
            return {"config": config, "topology": topology, "error": proc.stderr[-2000:], "exit": proc.returncode}
        r = json.load(open(out))
        r.update(exit=proc.returncode, wall_s=wall)
        return r


def run_peer(peer_python: str, topology: str, batch: int, seq: int, timeout: int) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([peer_python, os.path.abspath(__file__), "--worker=peer", f"--topology={topology}",
                           f"--batch={batch}", f"--seq={seq}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"impl": "hf-flax", "topology": topology, "error": proc.stderr[-2000:], "exit": proc.returncode}
    return json.loads(lines[-1])


def worker_peer(args) -> dict:
    """The HF Flax peer's step (``hf_flax_tacl.py --head mlm``, bf16 compute) compiled for the topology."""
    import warnings

    warnings.filterwarnings("ignore")
    import jax
    import jax.numpy as jnp
    import optax
    import transformers
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from transformers import BertConfig, FlaxBertForMaskedLM, FlaxBertModel

    from tacl_jax import hlo, topology

    transformers.logging.set_verbosity_error()
    topo = topology.topology(args.topology)
    devices = topology.compile_only_devices(args.topology)
    mesh = Mesh(devices, ("data",))
    cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2,
                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    student = FlaxBertForMaskedLM(cfg, input_shape=(1, args.seq), dtype=jnp.bfloat16, _do_init=False)
    teacher = FlaxBertModel(cfg, dtype=jnp.bfloat16, add_pooling_layer=False, _do_init=False)
    rng_aval = jax.ShapeDtypeStruct((2,), jnp.uint32)
    p_shapes = jax.eval_shape(lambda r: student.init_weights(r, (1, args.seq)), rng_aval)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0))
    o_shapes = jax.eval_shape(tx.init, p_shapes)
    temp = 0.01

    def loss_fn(p, tp, batch, rng):   # hf_flax_tacl.py's loss_fn, --head mlm
        r_s, r_t = jax.random.split(rng)
        out = student(batch["inp"], batch["attention_mask"], batch["seg"], params=p, dropout_rng=r_s, train=True,
                      output_hidden_states=True)
        rep = out.hidden_states[-1]
        msk = batch["msk"].astype(jnp.float32)
        logp = jax.nn.log_softmax(out.logits, axis=-1)
        tok_nll = -jnp.take_along_axis(logp, batch["truth"][..., None], axis=-1)[..., 0]
        mlm = (tok_nll * msk).sum() / msk.sum()
        t_out = teacher(batch["truth"], batch["attention_mask"], batch["seg"], params=tp, dropout_rng=r_t, train=True)
        t_rep = jax.lax.stop_gradient(t_out.last_hidden_state)
        s_n = rep / jnp.linalg.norm(rep, axis=2, keepdims=True)
        t_n = t_rep / jnp.linalg.norm(t_rep, axis=2, keepdims=True)
        scores = jnp.einsum("bih,bjh->bij", s_n, t_n) / temp
        diag = jnp.diagonal(jax.nn.log_softmax(scores, axis=-1), axis1=1, axis2=2)
        anchors = batch["contrastive_labels"]
        return mlm - (diag * anchors).sum() / anchors.sum()

    def step(p, o, tp, batch, rng):
        total, g = jax.value_and_grad(loss_fn)(p, tp, batch, rng)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, total

    repl, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    sds = lambda tree, sh: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree)  # noqa: E731
    bshape = (args.batch, args.seq)
    batch = {k: jax.ShapeDtypeStruct(bshape, jnp.float32 if k == "contrastive_labels" else jnp.int32, sharding=rows)
             for k in ("inp", "truth", "seg", "attention_mask", "msk", "contrastive_labels")}
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(repl, repl, repl))
    t0 = time.perf_counter()
    lowered = jitted.lower(sds(p_shapes, repl), sds(o_shapes, repl), sds(p_shapes["bert"], repl), batch,
                           jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl))
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    if os.environ.get("AOT_PEER_HLO"):
        with open(os.environ["AOT_PEER_HLO"], "w") as f:
            f.write(text)
    s = hlo.summarize(text)
    est = s.estimated_cycles / topo.clock_hz if s.estimated_cycles else None
    return {"impl": "hf-flax", "topology": args.topology, "batch": args.batch, "seq": args.seq,
            "estimated_step_s": est, "compile_s": compile_s,
            "peak_bytes": (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                           + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes),
            "collective_bytes": s.collective_bytes, "relayout_bytes": s.relayout_bytes,
            "estimated_s_by_kind": {k: v / topo.clock_hz for k, v in s.cycles_by_kind.items()},
            "unknown_cost_ops": s.unknown_cost_ops[:20],
            "transformers": transformers.__version__, "jax": jax.__version__}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", default=DEFAULT_PAIRS, help="CONFIG@TOPOLOGY,... (configs/CONFIG.py)")
    p.add_argument("--peer_python", default=os.environ.get("PEER_PYTHON", ""),
                   help="python of an environment with transformers<5, jax and libtpu; empty = no peer rows")
    p.add_argument("--gpu_python", default=os.environ.get("GPU_PYTHON", ""),
                   help="python of launch/aot_gpu_env.sh's environment: adds gpu_8xh100@h100x8")
    p.add_argument("--set", action="append", default=[], help="--config.x=v passed to every pair")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default="")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--topology", default="", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=256, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "peer":
        print(json.dumps(worker_peer(args)))
        return
    rows, peers = [], {}
    for pair in [x for x in args.pairs.split(",") if x]:
        config, topology = pair.split("@")
        r = run_ours(config, topology, args.set, args.timeout)
        rows.append(r)
        print(json.dumps({k: r.get(k) for k in ("config", "topology", "fits", "hbm_fraction", "estimated_step_s",
                                                 "estimated_mfu", "relayout_bytes", "collective_bytes", "compile_s",
                                                 "error")}), file=sys.stderr)
        tacl_base = r.get("architecture", "").find("hidden 768") >= 0 and "coco" not in config
        key = (topology, r.get("global_batch_size"), r.get("max_len"))
        if args.peer_python and tacl_base and key not in peers and r.get("estimated_step_s"):
            peers[key] = run_peer(args.peer_python, topology, key[1], key[2], args.timeout)
        if args.peer_python and key in peers and peers[key].get("estimated_step_s") and r.get("estimated_step_s"):
            r["peer_estimated_step_s"] = peers[key]["estimated_step_s"]
            r["speedup_vs_peer_estimated"] = peers[key]["estimated_step_s"] / r["estimated_step_s"]
    if args.gpu_python:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "g.json")
            subprocess.run([args.gpu_python, "-m", "tacl_jax.aot", f"--config={REPO}/configs/gpu_8xh100.py",
                            "--topology=h100x8", f"--json={out}", *args.set], cwd=REPO, env=env, timeout=args.timeout)
            if os.path.exists(out):
                rows.append(json.load(open(out)))
    result = {"bench": "aot_step", "rows": rows, "peers": list(peers.values())}
    text = json.dumps(result, indent=1, default=float)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
