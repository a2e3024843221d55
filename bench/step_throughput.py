"""Train-step throughput of tacl_jax against the PyTorch peer, in one run; prints one JSON object.

    python bench/step_throughput.py                       # small + base, fp32 + bf16, 2 rounds
    python bench/step_throughput.py --sizes=small --rounds=1 --steps=6
    python bench/step_throughput.py --ablate --sizes=small   # what each lever contributes
    python bench/step_throughput.py --breakdown --sizes=base --precisions=bf16   # where time goes
    python bench/step_throughput.py --remat --sizes=small_l512 --precisions=fp32 --steps=1 --warmup=1

What is compared. Our step is the training loop's: ``tacl_jax.train.setup.build_program``'s
jitted step on one CPU device (``init.from_scratch=True``, ``objective='tacl'``, NSP off, frozen
head-less teacher in fresh buffers, AdamW + clip 1.0, jitted with shardings, the state donated); the
masking runs inside our step. The peer is ``../shared/bench/torch_tacl.py --head mlm`` (the
original's arithmetic: full-vocabulary MLM logits at every position, teacher with dropout on,
fp32 eager PyTorch, 2 threads, masking done on the host outside its timing). Both use BERT's
synthetic batches (``[CLS] A [SEP] B [SEP]``, 10% short rows, bert-base-uncased ids), the same
sizes, and count ``tokens/s = batch · seq · timed_steps / Σ step time`` (padding included), each
step timed to completion (ours: ``block_until_ready``; the peer: ``loss.item()``).

Allocator. Every measured process, ours and the peer's, runs with the same allocator:
``--malloc=tuned`` (default) = what ``python -m tacl_jax.main`` runs with (tacl_jax.hostenv: glibc
tunables and the bigalloc shim, so big buffers are reused across steps instead of re-``mmap``-ed and
page-faulted in every step), ``--malloc=glibc`` = the tunables alone (``TACL_MALLOC_TUNING=glibc``),
``--malloc=system`` = glibc's defaults. ``--ablate`` has ``system_malloc`` and ``glibc_malloc`` rows.

Every measurement runs in its own subprocess, so peak memory is fair: each reports its own
``getrusage(RUSAGE_SELF).ru_maxrss`` (the peer does the same), i.e. the most the process ever held,
imports and compilation included. Per round the order
is alternated (peer first, then ours; next round ours first), and every ratio is ours / peer of
the *same round*; the JSON gives the median over rounds. Matmul peaks are measured in the same
run, in a subprocess per round: a jitted 2048³ ``jnp.dot`` in f32, and with bf16 inputs and f32
accumulation (``preferred_element_type=float32``); the best of the run is the peak.

Sizes: ``small`` = 4 layers, hidden 256, 4 heads, ffn 1024, L = 128, batch 16;
``base`` = bert-base (12, 768, 12, 3072), L = 128, batch 8. Vocabulary 30522 (bert-base-uncased).
Precisions: ``fp32`` (``model.dtype=float32``), ``default`` (``model.dtype=auto``, the project's
default: bf16 on TPU/GPU and on CPUs with bf16 matmul units, f32 elsewhere, see
``tacl_jax.precision``; the JSON's ``default_resolves_to`` says which) and ``bf16`` (``bfloat16``
compute, f32 params and accumulation, forced); the peer is always fp32.

MFU. Model FLOPs per token = ``tacl_jax.flops.sequence_flops`` (the formula ``flops_per_step`` and
the training loop's MFU use; its module doc gives it) of the default step, over its L tokens, with
P = the step's prediction slots (``step_config_from``: ``round(0.15·L)``, 19 at L = 128, what both
implementations predict at most per sequence); embeddings, LayerNorm, softmax, GELU, dropout and
the optimizer are not counted. ``MFU = tokens/s · FLOPs/token / peak``, per device (one CPU here).
The same useful FLOPs are used for the peer (which in fact computes the vocabulary projection and
the last layer at all L positions, so its hardware FLOPs are higher): ``mfu`` ratios equal
``tokens/s`` ratios. ``--full_flops`` counts the last layer and the TaCL scores at every position
instead (``gathered_last_layer=False, anchors=L``: the formula before the gathered last layer,
12.4% more FLOPs per token at ``small``, 4.6% at ``base``).

Targets (issue 5, 2-core CPU): fp32 ratio >= 2.5 (small) / 2.2 (base); default-precision ratio
>= 3.5 / 3.0; MFU at base >= 75% of the f32 peak in fp32 and >= 45% of the default precision's own
peak (the bf16 peak where it resolves to bf16, else the f32 peak); peak RSS no higher than the
peer's. The targets were set on a host with AVX-512 BF16; on one without, 'default' is f32 and the
bf16 row shows what forcing bf16 costs. The JSON's ``targets`` says which are met.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.normpath(os.path.join(REPO, "..", "shared", "bench", "torch_tacl.py"))

SIZES = {
    "small": dict(layers=4, hidden=256, heads=4, intermediate=1024, seq=128, batch=16),
    "base": dict(layers=12, hidden=768, heads=12, intermediate=3072, seq=128, batch=8),
    # For the remat row (issue 6): long sequences, where activations (the L x L attention
    # probabilities above all) outweigh the parameter-sized buffers.
    "small_l512": dict(layers=4, hidden=256, heads=4, intermediate=1024, seq=512, batch=32),
}
VOCAB = 30522
PRECISIONS = {"fp32": "float32", "default": "auto", "bf16": "bfloat16"}
TARGETS = {"small_fp32_ratio": 2.5, "base_fp32_ratio": 2.2, "small_default_ratio": 3.5, "base_default_ratio": 3.0,
           "base_fp32_mfu_of_f32_peak": 0.75, "base_default_mfu_of_its_peak": 0.45}
# Ablations (--ablate): one lever at a time, relative to the default step of that precision.
ABLATIONS = {
    "default": {},
    # MLM logits at every position, then gathered (and so the last layer at every position too)
    "full_vocab_head": {"full_vocab_head": True},
    # the student's last layer at every position instead of only at the predicted ones
    "full_last_layer": {"full_last_layer": True},
    "plain_autodiff": {"plain_autodiff": True},        # autodiff through dense/decoder (no custom_vjp)
    "jax_gelu": {"jax_gelu": True},                    # jax.nn.gelu (erfc) instead of the erf form
    "autodiff_xent": {"autodiff_xent": True},          # logsumexp + gather + argmax, autodiff
    # bf16 weight gradients as XLA:CPU lowers xᵀ·g (upcast to f32) instead of through a transposed
    # copy of x (tacl_jax.models.layers._rows_dot); no effect in fp32 or off the CPU.
    "xla_rows_dot": {"xla_rows_dot": True},
    # bf16 attention as XLA:CPU lowers the einsums (all six matmuls upcast to f32) instead of
    # through materialised copies and canonical dots (tacl_jax.models.attention); CPU bf16 only.
    "xla_attention": {"xla_attention": True},
    "teacher_f32_params": {"teacher_dtype": "float32"},    # the teacher cast to bf16 every step
    "teacher_bf16_params": {"teacher_dtype": "bfloat16"},  # every teacher leaf in bf16
    "prng_rbg": {"prng": "rbg"},
    "prng_unsafe_rbg": {"prng": "unsafe_rbg"},
    "no_dropout": {"no_dropout": True},
    # flax's nn.Dropout (one threefry block per element) instead of four 16-bit uniforms per block
    # (tacl_jax.models.dropout).
    "dropout_bits32": {"dropout_bits": 32},
    # optax's clip + adamw chain instead of the same update fused per parameter (optim.fused).
    "optax_adamw": {"optax_adamw": True},
    # The process's allocator, not a flag of the step: glibc's defaults, or the glibc tunables
    # without the bigalloc shim, instead of both (tacl_jax.hostenv) that every other row, the
    # peer's included, runs with.
    "system_malloc": {"_malloc": "system"},
    "glibc_malloc": {"_malloc": "glibc"},
}
MALLOC = {"malloc": "tuned"}   # set from --malloc in main(); read by _worker_env / _peer_env


# ----------------------------------------------------------------------------- the step's config and FLOPs

def bench_config(args):
    """The run config of our step at ``args.size`` / ``args.precision`` with the worker's levers
    (``parse_args`` defaults: the default step)."""
    sys.path.insert(0, REPO)
    from tacl_jax import config as config_lib

    sz = SIZES[args.size]
    c = config_lib.default_config()
    c.objective = "tacl"
    c.nsp = False
    c.init.from_scratch = True
    c.init.scratch.update(vocab_size=VOCAB, hidden_size=sz["hidden"], num_hidden_layers=sz["layers"],
                          num_attention_heads=sz["heads"], intermediate_size=sz["intermediate"],
                          max_position_embeddings=512)
    c.max_len = sz["seq"]
    c.global_batch_size = sz["batch"]
    c.num_train_steps = args.warmup + args.steps
    c.model.dtype = PRECISIONS[args.precision]
    c.tacl.teacher_param_dtype = args.teacher_dtype
    c.model.remat_policy = args.remat_policy
    c.model.scan_layers = bool(args.scan_layers)
    c.model.dropout_bits = args.dropout_bits
    # The full-vocabulary head needs every position's last-layer state.
    c.model.gather_last_layer = not (args.full_last_layer or args.full_vocab_head)
    c.optim.fused = not args.optax_adamw
    if args.no_dropout:
        c.model.hidden_dropout_prob = 0.0
        c.model.attention_probs_dropout_prob = 0.0
    config_lib.validate(c)
    return c


def model_flops_per_token(size: str, gathered_last_layer: bool = True) -> dict:
    """``tacl_jax.flops.sequence_flops`` of the default step at ``size`` (its prediction slots:
    ``step_config_from``'s), per token, with ``predictions_per_sequence``.
    ``gathered_last_layer=False`` (``--full_flops``): the last layer and the TaCL scores at every
    position."""
    sys.path.insert(0, REPO)
    from tacl_jax import tokens
    from tacl_jax.flops import sequence_flops
    from tacl_jax.train import setup
    from tacl_jax.train.step import step_config_from

    c = bench_config(parse_args([f"--size={size}"]))
    sc = step_config_from(c, tokens.default_special_ids(VOCAB))
    parts = sequence_flops(setup.bert_config(c, None, "cpu"), length=c.max_len, predictions=sc.max_predictions,
                           teacher=sc.uses_teacher, gathered_last_layer=sc.gather_last_layer and gathered_last_layer,
                           anchors=None if gathered_last_layer else c.max_len)
    out = {k: v / c.max_len for k, v in parts.items()}
    out["predictions_per_sequence"] = sc.max_predictions
    return out


# ----------------------------------------------------------------------------- workers (subprocesses)

def _malloc_env(env: dict, malloc: str | None = None) -> dict:
    """``env`` with the allocator of ``--malloc``: 'tuned' = tacl_jax.hostenv's glibc tunables and
    bigalloc shim (what ``python -m tacl_jax.main`` runs with), 'glibc' = the tunables alone,
    'system' = glibc's defaults. Applied to our workers and to the peer alike, so the comparison
    is of the steps, not of the allocators."""
    malloc = malloc or MALLOC["malloc"]
    sys.path.insert(0, REPO)
    from tacl_jax import hostenv

    env = {k: v for k, v in env.items() if k not in hostenv.ALLOCATOR_VARS}
    if malloc in ("tuned", "glibc"):
        # The workers run on the CPU (JAX_PLATFORMS=cpu below), whatever accelerator the host has.
        tuned = hostenv.tuned_env({**env, "JAX_PLATFORMS": "cpu",
                                   hostenv.SWITCH: "auto" if malloc == "tuned" else "glibc"})
        if tuned is None or (malloc == "tuned" and "bigalloc" not in tuned.get("LD_PRELOAD", "")):
            raise SystemExit(f"--malloc={malloc}: not available here (needs glibc, and for 'tuned' a working C "
                             "compiler `cc` to build the bigalloc shim); pass --malloc=glibc or --malloc=system")
        env = tuned
    env[hostenv.SWITCH] = "off"   # a worker that imports tacl_jax.main must not re-execute
    return env


def _worker_env(malloc: str | None = None) -> dict:
    env = _malloc_env(dict(os.environ), malloc)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # One CPU device (a test runner may have forced 8 fake ones).
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def worker_matmul(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    n, reps = args.matmul_n, args.matmul_reps
    out = {}
    for name, dt in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dt)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dt)
        f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        f(a, b).block_until_ready()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        flops = 2.0 * n ** 3
        out[f"{name}_gflops_best"] = flops / min(times) / 1e9
        out[f"{name}_gflops_median"] = flops / float(np.median(times)) / 1e9
    return out


def _build_ours(args):
    """Config, model, state, teacher and the jitted step, as ``tests/test_train.py::_setup`` and
    the training loop build them."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    if args.prng != "threefry":
        jax.config.update("jax_default_prng_impl", args.prng)
    from tacl_jax import tokens
    from tacl_jax.train import setup

    if args.plain_autodiff:
        from tacl_jax.models import layers

        # Ablation only: plain autodiff through the dense layers and the tied decoder (bias
        # gradients by reduce_sum, transposes as XLA chooses, f32 cotangents in bf16 mode).
        def cast(dtype_name):
            dt = jnp.dtype(dtype_name)
            return dt, lambda a: a.astype(dt)

        def plain(dtype_name):
            dt, c = cast(dtype_name)
            return lambda x, w: jnp.dot(c(x), c(w), preferred_element_type=jnp.float32)

        def plain_bias(dtype_name):
            dt, c = cast(dtype_name)
            return lambda x, w, b: jnp.dot(c(x), c(w), preferred_element_type=jnp.float32) + b.astype(jnp.float32)

        def plain_decoder(dtype_name):
            dt, c = cast(dtype_name)
            return lambda h, t, b: jnp.dot(c(h), c(t).T, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
        layers._matmul_for, layers._matmul_bias_for, layers._decoder_for = plain, plain_bias, plain_decoder
    if args.xla_rows_dot:
        from tacl_jax.models import layers

        layers.CPU_BF16_TRANSPOSED_COPY = False
    if args.xla_attention:
        from tacl_jax.models import attention

        attention._use_canonical_copies = lambda q: False
    if args.jax_gelu:
        from tacl_jax.models import bert

        bert.gelu = lambda x: jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)
    if args.autodiff_xent:
        from tacl_jax.objectives import combined

        def xent(logits, targets):
            logits = logits.astype(jnp.float32)
            logz = jax.nn.logsumexp(logits, axis=-1)
            gold = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
            return logz - gold, (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
        combined.mlm_per_position = xent

    c = bench_config(args)
    if args.full_vocab_head:
        # Ablation only: the student built as FullHeadBert (the class the TaCL objective builds).
        from tacl_jax.train import step as step_lib
        step_lib.BertModel = _full_head_model_class()
    prog = setup.build_program(c, jax.devices()[:1], special_ids=tokens.default_special_ids(VOCAB))
    state, teacher = prog.create_state(), prog.create_teacher()   # the teacher: the seed's init, as the state
    # prog.train_step: jitted as the training loop runs it (shardings given, the state donated).
    batches = synthetic_batches(prog)
    ctx = (jax.set_mesh(prog.mesh), nn.logical_axis_rules(prog.rules))
    return dict(config=c, prog=prog, model=prog.model, state=state, teacher=teacher, p_step=prog.train_step,
                batches=batches, ctx=ctx, step_cfg=prog.step_cfg, rng=jax.random.key(c.seed))


def synthetic_batches(prog) -> list:
    """``num_train_steps`` global batches for ``prog``'s step (a ``setup.Program``): BERT's synthetic
    ``[CLS] A [SEP] B [SEP]`` rows (10% short, bert-base-uncased ids, ``prog.special_ids``)."""
    from tacl_jax.data import synthetic

    c, special = prog.config, prog.special_ids
    return [prog.global_batch(synthetic.global_batch(
        c.seed, s, c.global_batch_size, max_len=c.max_len, vocab_size=VOCAB, first_regular_id=999,
        cls_id=special["cls"], sep_id=special["sep"], pad_id=special["pad"], short_seq_prob=0.1))
        for s in range(c.num_train_steps)]


def _full_head_model_class():
    """Ablation: a BertModel with the vocabulary projection at every position, gathered afterwards
    (the peer's arithmetic); same parameters and outputs as the gathered head."""
    import jax.numpy as jnp

    from tacl_jax.models import BertModel

    class FullHeadBert(BertModel):
        def mlm_logits(self, hidden, positions=None, padded_vocab=False):
            logits = super().mlm_logits(hidden, None, padded_vocab)
            if positions is None:
                return logits
            return jnp.take_along_axis(logits, positions[..., None].astype(jnp.int32), axis=1)

    return FullHeadBert


def worker_ours(args) -> dict:
    import jax

    t0 = time.perf_counter()
    b = _build_ours(args)
    build_s = time.perf_counter() - t0
    with b["ctx"][0], b["ctx"][1]:
        t0 = time.perf_counter()
        compiled = b["p_step"].lower(b["state"], b["teacher"], b["batches"][0], b["rng"]).compile()
        compile_s = time.perf_counter() - t0
        # XLA's own account of the step's buffers: temp = activations and scratch (what remat cuts),
        # independent of compile-time peaks that ru_maxrss also sees.
        mem = compiled.memory_analysis()
        temp_mb = getattr(mem, "temp_size_in_bytes", 0) / 2**20 if mem is not None else None
        state, times, losses = b["state"], [], []
        for i, batch in enumerate(b["batches"]):
            t0 = time.perf_counter()
            state, metrics = compiled(state, b["teacher"], batch, b["rng"])
            jax.block_until_ready((state, metrics))
            dt = time.perf_counter() - t0
            losses.append(float(metrics["loss"]))
            if i >= args.warmup:
                times.append(dt)
        if args.profile_dir:
            jax.profiler.start_trace(args.profile_dir)
            for batch in b["batches"][:3]:
                state, metrics = compiled(state, b["teacher"], batch, b["rng"])
            jax.block_until_ready((state, metrics))
            jax.profiler.stop_trace()
    sz = SIZES[args.size]
    tok = sz["batch"] * sz["seq"]
    return dict(impl="tacl_jax", tokens_per_s=tok * len(times) / sum(times),
                step_ms_median=1000 * statistics.median(times), step_ms_all=[round(1000 * t, 1) for t in times],
                compile_s=compile_s, build_s=build_s, loss_first=losses[0], loss_last=losses[-1],
                max_predictions=b["step_cfg"].max_predictions, xla_temp_mb=temp_mb)


def worker_breakdown(args) -> dict:
    """Where the time of one step goes: each part jitted and timed on its own (median of
    ``--steps`` runs): the teacher forward, the student forward + loss, the loss and its
    gradients (both forwards, the backward), and the whole step (+ clip, AdamW)."""
    import jax
    import jax.numpy as jnp

    from tacl_jax.objectives import mask_tokens, objective_sums
    from tacl_jax.train.step import make_loss_and_grads, student_forward

    b = _build_ours(args)
    model, sc, teacher_model = b["model"], b["step_cfg"], b["prog"].teacher_model
    params, teacher, batch, rng = b["state"].params, b["teacher"], b["batches"][0], b["rng"]
    vocab = model.config.vocab_size

    def masked(batch, r):
        return mask_tokens(r, batch["input_ids"], batch["attention_mask"], max_predictions=sc.max_predictions,
                           mask_id=sc.mask_id, vocab_size=vocab, special_ids=sc.special_ids)

    def teacher_fwd(tp, batch):
        return teacher_model.apply({"params": tp}, batch["input_ids"], batch["attention_mask"],
                                   batch["token_type_ids"], deterministic=True, heads=False).last_hidden_state

    def student_loss(p, tp, batch, r):
        m = masked(batch, r)
        th = teacher_fwd(tp, batch)
        out = student_forward(model, sc, p, m.input_ids, batch["attention_mask"], batch["token_type_ids"],
                              m.positions, deterministic=False, rngs={"dropout": r})
        s = objective_sums(mlm_logits=out.mlm_logits, masked=m, student_hidden=out.last_hidden_state,
                           teacher_hidden=th, key_mask=batch["attention_mask"], temperature=sc.temperature,
                           student_at_slots=sc.gather_last_layer)
        return s["mlm_nll"] / s["n_pred"] + s["tacl_nll"] / s["n_anchor"]

    def student_fwd_only(p, batch, r):
        m = masked(batch, r)
        out = student_forward(model, sc, p, m.input_ids, batch["attention_mask"], batch["token_type_ids"],
                              m.positions, deterministic=False, rngs={"dropout": r})
        return out.mlm_logits.sum() + out.last_hidden_state.astype(jnp.float32).sum()

    lag = make_loss_and_grads(model, sc, teacher_model)
    parts = {
        "masking": (jax.jit(lambda batch, r: masked(batch, r).input_ids), (batch, rng)),
        "teacher_forward": (jax.jit(teacher_fwd), (teacher, batch)),
        "student_forward": (jax.jit(student_fwd_only), (params, batch, rng)),
        "forward_and_loss": (jax.jit(student_loss), (params, teacher, batch, rng)),
        "loss_and_grads": (jax.jit(lambda p, tp, bb, r: lag(p, tp, bb, r)[2]), (params, teacher, batch, rng)),
    }
    out = {}
    with b["ctx"][0], b["ctx"][1]:
        for name, (fn, fargs) in parts.items():
            c = fn.lower(*fargs).compile()
            jax.block_until_ready(c(*fargs))
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                jax.block_until_ready(c(*fargs))
                ts.append(time.perf_counter() - t0)
            out[f"{name}_ms"] = 1000 * statistics.median(ts)
        compiled = b["p_step"].lower(b["state"], teacher, batch, rng).compile()
        state, ts = b["state"], []
        for i in range(args.steps + 1):
            t0 = time.perf_counter()
            state, m = compiled(state, teacher, batch, rng)
            jax.block_until_ready((state, m))
            if i:
                ts.append(time.perf_counter() - t0)
        out["train_step_ms"] = 1000 * statistics.median(ts)
    out["backward_ms (loss_and_grads - forward_and_loss)"] = out["loss_and_grads_ms"] - out["forward_and_loss_ms"]
    out["optimizer_ms (train_step - loss_and_grads)"] = out["train_step_ms"] - out["loss_and_grads_ms"]
    return out


# ----------------------------------------------------------------------------- orchestration

def _run(cmd: list[str], timeout: float, env=None) -> dict:
    """Runs a measurement subprocess; its last stdout line is JSON (with its own ``peak_rss_mb``)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or _worker_env())
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
        return dict(error=f"timeout after {timeout}s", cmd=" ".join(cmd))
    wall = time.perf_counter() - t0
    lines = [line for line in stdout.strip().splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        return dict(error=f"exit {p.returncode}: {stderr.strip()[-1500:]}", cmd=" ".join(cmd))
    res = json.loads(lines[-1])
    res["wall_s"] = wall
    return res


def _ours_cmd(size, precision, args, **variant) -> list[str]:
    variant = {k: v for k, v in variant.items() if not k.startswith("_")}   # env-level, not flags
    cmd = [sys.executable, os.path.abspath(__file__), "--worker=ours", f"--size={size}", f"--precision={precision}",
           f"--steps={args.steps}", f"--warmup={args.warmup}"]
    for k, v in variant.items():
        if v is True:
            cmd.append(f"--{k}")
        elif v not in (None, False):
            cmd.append(f"--{k}={v}")
    return cmd


def _peer_cmd(size, args) -> list[str]:
    s = SIZES[size]
    return [args.peer_python, PEER, "--layers", str(s["layers"]), "--hidden", str(s["hidden"]), "--heads",
            str(s["heads"]), "--intermediate", str(s["intermediate"]), "--vocab", str(VOCAB), "--seq",
            str(s["seq"]), "--batch", str(s["batch"]), "--steps", str(args.steps), "--warmup-steps",
            str(args.warmup), "--threads", str(args.threads), "--head", "mlm"]


def _peer_env(args) -> dict:
    env = _malloc_env(dict(os.environ))
    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    return env


def _resolve_default() -> str:
    """What ``model.dtype='auto'`` resolves to on this machine (CPU backend)."""
    sys.path.insert(0, REPO)
    from tacl_jax.precision import resolve_compute_dtype

    return resolve_compute_dtype("auto", backend="cpu")


def cpu_info() -> dict:
    """The CPU's vector extensions: bf16 matmuls are fast only with AVX512_BF16 / AMX."""
    sys.path.insert(0, REPO)
    from tacl_jax.precision import cpu_flags

    flags = cpu_flags()
    return {k: k in flags for k in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main_compare(args) -> dict:
    sizes, precisions = args.sizes.split(","), args.precisions.split(",")
    rounds, peaks = [], []
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    for r in range(args.rounds):
        rec = {"matmul": _run([sys.executable, os.path.abspath(__file__), "--worker=matmul"], 600)}
        peaks.append(rec["matmul"])
        log(f"round {r}: matmul {rec['matmul']}")
        for size in sizes:
            jobs = [("peer", None)] + [("ours", p) for p in precisions]
            if r % 2:
                jobs.reverse()
            for kind, prec in jobs:
                if kind == "peer":
                    res = _run(_peer_cmd(size, args), args.timeout, env=_peer_env(args))
                    rec[f"{size}_peer"] = res
                else:
                    res = _run(_ours_cmd(size, prec, args), args.timeout)
                    rec[f"{size}_{prec}"] = res
                log(f"round {r}: {size} {kind} {prec or ''}: "
                    f"{res.get('tokens_per_s', res.get('error'))} tok/s, rss {res.get('peak_rss_mb')} MB")
        rounds.append(rec)

    f32_peak = max(p.get("f32_gflops_best", 0) for p in peaks) * 1e9
    bf16_peak = max(p.get("bf16_gflops_best", 0) for p in peaks) * 1e9
    out = {"default_resolves_to": _resolve_default(), "matmul_f32_gflops_peak": f32_peak / 1e9, "matmul_bf16_gflops_peak": bf16_peak / 1e9,
           "matmul_f32_gflops_median": _median([p.get("f32_gflops_median") for p in peaks]),
           "matmul_bf16_gflops_median": _median([p.get("bf16_gflops_median") for p in peaks])}
    for size in sizes:
        fl = model_flops_per_token(size, gathered_last_layer=not args.full_flops)
        out[f"{size}_model_flops_per_token"] = fl["total"]
        peer = [rec[f"{size}_peer"] for rec in rounds]
        peer_tps = _median([p.get("tokens_per_s") for p in peer])
        out[f"{size}_peer_tokens_per_s"] = peer_tps
        out[f"{size}_peer_step_ms"] = _median([p.get("step_ms_median") for p in peer])
        out[f"{size}_peer_peak_rss_mb"] = _median([p.get("peak_rss_mb") for p in peer])
        if peer_tps:
            out[f"{size}_peer_mfu_of_f32_peak"] = peer_tps * fl["total"] / f32_peak
        for prec in precisions:
            ours = [rec[f"{size}_{prec}"] for rec in rounds]
            tps = _median([o.get("tokens_per_s") for o in ours])
            key = f"{size}_{prec}"
            out[f"{key}_tokens_per_s"] = tps
            out[f"{key}_step_ms"] = _median([o.get("step_ms_median") for o in ours])
            out[f"{key}_peak_rss_mb"] = _median([o.get("peak_rss_mb") for o in ours])
            out[f"{key}_compile_s"] = _median([o.get("compile_s") for o in ours])
            per_round = [o["tokens_per_s"] / p["tokens_per_s"] for o, p in zip(ours, peer)
                         if o.get("tokens_per_s") and p.get("tokens_per_s")]
            out[f"{key}_ratio"] = _median(per_round)
            out[f"{key}_ratio_per_round"] = per_round
            if tps:
                achieved = tps * fl["total"]
                out[f"{key}_model_gflops"] = achieved / 1e9
                out[f"{key}_mfu_of_f32_peak"] = achieved / f32_peak
                if prec == "bf16":
                    out[f"{key}_mfu_of_bf16_peak"] = achieved / bf16_peak
                if prec == "default":
                    own = bf16_peak if out["default_resolves_to"] == "bfloat16" else f32_peak
                    out[f"{key}_mfu_of_its_peak"] = achieved / own
            if out[f"{key}_peak_rss_mb"] and out[f"{size}_peer_peak_rss_mb"]:
                out[f"{key}_rss_vs_peer"] = out[f"{key}_peak_rss_mb"] / out[f"{size}_peer_peak_rss_mb"]
    targets = {}
    for k, goal in TARGETS.items():
        if out.get(k) is not None:
            targets[k] = dict(value=round(out[k], 3), goal=goal, met=out[k] >= goal)
    for size in sizes:
        for prec in precisions:
            k = f"{size}_{prec}_rss_vs_peer"
            if out.get(k) is not None:
                targets[k] = dict(value=round(out[k], 3), goal="<= 1", met=out[k] <= 1.0)
    out["targets"] = targets
    if args.coco_lm:
        # COCO-LM's step at `small` (issue 7's row), in its own process like every measurement.
        for prec in precisions:
            row = _run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "coco_lm_step.py"),
                        "--size=small", f"--precision={prec}", f"--steps={args.steps}",
                        f"--warmup={args.warmup}"], args.timeout)
            for k in ("tokens_per_s", "step_ms_median", "mfu_of_f32_peak", "mfu_of_bf16_peak", "peak_rss_mb",
                      "error"):
                if k in row:
                    out[f"coco_lm_small_{prec}_{k}"] = row[k]
    out["settings"] = dict(malloc=MALLOC["malloc"], rounds=args.rounds, steps=args.steps, warmup=args.warmup, threads=args.threads,
                           peer="torch_tacl.py --head mlm", cpu_count=os.cpu_count(),
                           load_avg_end=os.getloadavg(), cpu=cpu_info())
    out["raw"] = rounds
    return out


def main_ablate(args) -> dict:
    """One lever at a time at each size/precision, alternated over rounds; ratios to default."""
    sizes, precisions = args.sizes.split(","), args.precisions.split(",")
    names = [n for n in (args.ablations.split(",") if args.ablations else ABLATIONS)]
    res = {}
    for r in range(args.rounds):
        for size in sizes:
            for prec in precisions:
                order = names if r % 2 == 0 else list(reversed(names))
                for name in order:
                    o = _run(_ours_cmd(size, prec, args, **ABLATIONS[name]), args.timeout,
                             env=_worker_env(ABLATIONS[name].get("_malloc")))
                    res.setdefault(f"{size}_{prec}", {}).setdefault(name, []).append(o)
                    print(f"ablate r{r} {size} {prec} {name}: {o.get('tokens_per_s', o.get('error'))}",
                          file=sys.stderr, flush=True)
    out = {}
    for key, by_name in res.items():
        base = by_name["default"]
        for name, runs in by_name.items():
            tps = _median([x.get("tokens_per_s") for x in runs])
            ratios = [x["tokens_per_s"] / d["tokens_per_s"] for x, d in zip(runs, base)
                      if x.get("tokens_per_s") and d.get("tokens_per_s")]
            out[f"{key}_{name}_tokens_per_s"] = tps
            out[f"{key}_{name}_vs_default"] = _median(ratios)
            out[f"{key}_{name}_peak_rss_mb"] = _median([x.get("peak_rss_mb") for x in runs])
    out["raw"] = res
    return out


def main_remat(args) -> dict:
    """Peak memory and speed of our step per rematerialisation policy (issue 6's bench row), with
    the layers unrolled and scanned, each in its own process so that ``ru_maxrss`` is the step's
    own. On XLA:CPU remat saves memory only with ``scan_layers``: unrolled, its scheduler runs the
    recomputations early and keeps them all."""
    out = dict(bench="step_throughput_remat", device="cpu", cpu=cpu_info())
    for size in args.sizes.split(","):
        for prec, scan in [(p, s) for p in args.precisions.split(",") for s in (False, True)]:
            base = None
            for policy in ("none", "full", "save_dots"):
                r = _run(_ours_cmd(size, prec, args, remat_policy=policy, scan_layers=scan), args.timeout)
                key = f"{size}_{prec}{'_scan' if scan else ''}_remat_{policy}"
                out[f"{key}_peak_rss_mb"] = r.get("peak_rss_mb")
                out[f"{key}_tokens_per_s"] = r.get("tokens_per_s")
                out[f"{key}_xla_temp_mb"] = r.get("xla_temp_mb")
                if "error" in r:
                    out[f"{key}_error"] = r["error"]
                if policy == "none":
                    base = r
                elif base and r.get("peak_rss_mb") and base.get("peak_rss_mb"):
                    out[f"{key}_rss_vs_none"] = r["peak_rss_mb"] / base["peak_rss_mb"]
                    if r.get("xla_temp_mb") and base.get("xla_temp_mb"):
                        out[f"{key}_xla_temp_vs_none"] = r["xla_temp_mb"] / base["xla_temp_mb"]
    return out


def main_breakdown(args) -> dict:
    out = {}
    for size in args.sizes.split(","):
        for prec in args.precisions.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker=breakdown", f"--size={size}",
                   f"--precision={prec}", f"--steps={args.steps}"]
            out[f"{size}_{prec}"] = _run(cmd, args.timeout)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,base")
    p.add_argument("--precisions", default="fp32,default,bf16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=2, help="the peer's torch threads")
    p.add_argument("--peer_python", default=os.environ.get("PEER_PYTHON", sys.executable),
                   help="python with torch + transformers for the peer (default: this one)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per measurement")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--malloc", choices=("tuned", "glibc", "system"), default="tuned",
                   help="allocator of every measured process, ours and the peer's (tacl_jax.hostenv)")
    p.add_argument("--ablate", action="store_true", help="measure the levers (see ABLATIONS)")
    p.add_argument("--ablations", default="", help="comma-separated subset of ABLATIONS")
    p.add_argument("--breakdown", action="store_true", help="time the parts of our step")
    p.add_argument("--remat", action="store_true", help="peak memory per model.remat_policy (none/full/save_dots)")
    p.add_argument("--remat_policy", default="none", help=argparse.SUPPRESS)
    p.add_argument("--coco_lm", action="store_true", help="add COCO-LM step rows at `small` (bench/coco_lm_step.py)")
    # worker-only
    p.add_argument("--worker", choices=("ours", "matmul", "breakdown"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", default="small", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    p.add_argument("--prng", default="threefry", help=argparse.SUPPRESS)
    p.add_argument("--teacher_dtype", default="compute", help=argparse.SUPPRESS)
    p.add_argument("--dropout_bits", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--full_flops", action="store_true",
                   help="MFU from FLOPs with the last layer at every position (see the module doc)")
    # the levers of ABLATIONS and --remat (worker-only switches)
    for lever in ("scan_layers", "no_dropout", "optax_adamw", "full_vocab_head", "full_last_layer", "plain_autodiff",
                  "jax_gelu", "xla_rows_dot", "xla_attention", "autodiff_xent"):
        p.add_argument(f"--{lever}", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--matmul_n", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--matmul_reps", type=int, default=5, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _main_worker(args) -> None:
    import resource

    fn = {"ours": worker_ours, "matmul": worker_matmul, "breakdown": worker_breakdown}[args.worker]
    res = fn(args)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from tacl_jax import hostenv

    res["bigalloc"] = hostenv.bigalloc_stats()   # None: not preloaded (--malloc=glibc|system)
    print(json.dumps(res))


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    MALLOC["malloc"] = args.malloc
    if args.worker:
        _main_worker(args)
        return None
    if args.ablate:
        out = main_ablate(args)
    elif args.breakdown:
        out = main_breakdown(args)
    elif args.remat:
        out = main_remat(args)
    else:
        out = main_compare(args)
    text = json.dumps(out, default=float)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return out


if __name__ == "__main__":
    main()
