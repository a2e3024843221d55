"""The training loop, read top to bottom: start-up → mesh → model → state → input → step → loop.

``train_and_evaluate(config, workdir)`` is what ``python -m tacl_jax.main`` runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tacl_jax import config as config_lib
from tacl_jax import hf, parallel, tokens
from tacl_jax.data import synthetic
from tacl_jax.models import BertConfig, BertModel, to_dtype
from tacl_jax.train.optimizer import make_optimizer
from tacl_jax.train.state import TrainState
from tacl_jax.train.step import jit_train_step, make_train_step, step_config_from

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- model

def build_model(config) -> tuple[BertModel, dict | None]:
    """The student's module and, when ``init.hf_path`` is set, its pretrained params (numpy)."""
    numerics = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                    remat_policy=config.model.remat_policy, vocab_multiple=config.model.vocab_multiple,
                    hidden_dropout_prob=config.model.hidden_dropout_prob,
                    attention_probs_dropout_prob=config.model.attention_probs_dropout_prob,
                    with_nsp_head=config.nsp, with_pooler=True, with_mlm_head=True)
    if config.init.hf_path:
        model, params = hf.load(config.init.hf_path, seed=config.seed, **numerics)
        return model, params
    return BertModel(BertConfig(**dict(config.init.scratch), **numerics)), None


def teacher_of(model: BertModel) -> BertModel:
    """The teacher is the same module without heads: TaCL only reads its last hidden state."""
    return BertModel(model.config.replace(with_mlm_head=False, with_pooler=False, with_nsp_head=False))


def strip_heads(params: dict) -> dict:
    return {k: v for k, v in params.items() if k in ("embeddings", "encoder")}


# ----------------------------------------------------------------------------- checks

def check_batch_arithmetic(config, mesh) -> None:
    """Global batch vs processes vs data-parallel devices vs accumulation, with the fix."""
    b, k = config.global_batch_size, config.grad_accum_steps
    dp, procs = parallel.data_parallel_size(mesh), jax.process_count()
    if b % procs:
        raise ValueError(f"global_batch_size {b} is not divisible by the {procs} processes; "
                         f"use a multiple of {procs}")
    if b % dp:
        raise ValueError(f"global_batch_size {b} is not divisible by the data-parallel size {dp} "
                         f"(mesh data×fsdp); use a multiple of {dp} or change config.mesh")
    if (b // k) % dp:
        raise ValueError(f"a micro-batch of {b // k} (global_batch_size {b} / grad_accum_steps {k}) is not "
                         f"divisible by the data-parallel size {dp}; lower grad_accum_steps")


def check_model(config, model: BertModel) -> None:
    if config.max_len > model.config.max_position_embeddings:
        raise ValueError(f"max_len {config.max_len} exceeds the model's max_position_embeddings "
                         f"{model.config.max_position_embeddings}; lower config.max_len")


# ----------------------------------------------------------------------------- state

def create_state(model: BertModel, tx, mesh, rules, seed: int, max_len: int, init_params=None):
    """The student's ``TrainState`` created sharded, and its shardings.

    From scratch the params are initialised on device already sharded; from a checkpoint every
    process places its shards of the host copy.
    """
    def init_params_fn(rng):
        return model.init(rng, jnp.zeros((1, max_len), jnp.int32))["params"]

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(init_params_fn, jax.random.key(seed))
        param_sh = parallel.logical_shardings(abstract, mesh, rules)
        if init_params is None:
            params = jax.jit(lambda r: nn.meta.unbox(init_params_fn(r)), out_shardings=param_sh)(
                jax.random.key(seed))
        else:
            expected = jax.tree.map(lambda a: a.shape, nn.meta.unbox(abstract))
            got = jax.tree.map(lambda a: tuple(a.shape), init_params)
            if jax.tree.structure(expected) != jax.tree.structure(got) or expected != got:
                raise ValueError("the checkpoint's parameter tree does not match the model built from "
                                 "its config (different heads or shapes)")
            params = parallel.place(init_params, param_sh)
        abstract_opt = jax.eval_shape(tx.init, params)
        opt_sh = _optimizer_shardings(tx, abstract_opt, param_sh, parallel.replicated(mesh))
        opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), parallel.replicated(mesh)),
                       params=params, opt_state=opt_state)
    shardings = TrainState(step=parallel.replicated(mesh), params=param_sh, opt_state=opt_sh)
    return state, shardings


def _optimizer_shardings(tx, abstract_opt, param_sh, repl):
    """Optimizer-state leaves that mirror a parameter get its sharding; counters are replicated."""
    import optax

    return optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                 transform_non_params=lambda _: repl,
                                 is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def create_teacher(student_params, param_sh, dtype: str):
    """A frozen copy of the student's encoder, optionally in bf16, in fresh buffers (the student's
    are donated every step)."""
    dt = to_dtype(dtype)
    enc, enc_sh = strip_heads(student_params), strip_heads(param_sh)
    copy = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dt) if x.dtype != dt else x + 0, p),
                   out_shardings=enc_sh)
    return copy(enc), enc_sh


# ----------------------------------------------------------------------------- metrics

class MetricWriter:
    """Console line and ``metrics.jsonl`` in the workdir, from process 0 only."""

    def __init__(self, workdir: str):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)

    def write(self, step: int, metrics: dict[str, float], total_steps: int) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        keys = [k for k in ("loss", "mlm_loss", "mlm_acc", "tacl_loss", "tacl_acc", "nsp_loss", "grad_norm", "lr")
                if k in metrics]
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys)
        rate = metrics.get("tokens_per_s")
        log.info("step %d/%d %s%s", step, total_steps, shown, f" tok/s={rate:,.0f}" if rate else "")


# ----------------------------------------------------------------------------- main loop

def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
    """Train per ``config``; write metrics to ``workdir``. Returns the last step's metrics."""
    # --- start-up
    parallel.maybe_initialize_distributed(config.distributed)
    config_lib.validate(config)
    workdir = os.path.abspath(workdir) if "://" not in workdir else workdir
    rules = parallel.rules_from_config(config.logical_axis_rules)

    # --- mesh
    mesh = parallel.make_mesh(dict(config.mesh))
    check_batch_arithmetic(config, mesh)
    log.info("mesh %s over %d processes; global batch %d (%d per process), %d micro-batch(es)",
             dict(mesh.shape), jax.process_count(), config.global_batch_size,
             config.global_batch_size // jax.process_count(), config.grad_accum_steps)

    # --- model
    model, hf_params = build_model(config)
    check_model(config, model)
    tok_dir = config.init.tokenizer_path or config.init.hf_path
    special = (tokens.special_ids_from_tokenizer(tok_dir) if tok_dir
               else tokens.default_special_ids(model.config.vocab_size))
    log.info("model: %d layers, hidden %d, vocab %d (padded %d), compute %s; init %s", model.config.num_hidden_layers,
             model.config.hidden_size, model.config.vocab_size, model.config.padded_vocab_size, model.config.dtype,
             config.init.hf_path or "from scratch")

    # --- state
    tx, schedule = make_optimizer(config.optim, config.num_train_steps)
    state, state_sh = create_state(model, tx, mesh, rules, config.seed, config.max_len, hf_params)
    del hf_params
    teacher, teacher_sh = None, None
    step_cfg = step_config_from(config, special)
    if step_cfg.uses_teacher:
        teacher, teacher_sh = create_teacher(state.params, state_sh.params, config.tacl.teacher_param_dtype)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    log.info("student: %.2fM parameters; objective %s", n_params / 1e6, config.objective)

    # --- input
    def local_batch(step: int) -> dict[str, np.ndarray]:
        return synthetic.local_batch(
            config.seed, step, config.global_batch_size, jax.process_index(), jax.process_count(),
            max_len=config.max_len, vocab_size=model.config.vocab_size,
            first_regular_id=999 if model.config.vocab_size > 2000 else 5,
            cls_id=special["cls"], sep_id=special["sep"], pad_id=special["pad"],
            short_seq_prob=config.data.short_seq_prob, with_nsp=config.nsp)

    # --- step
    train_step = make_train_step(model, step_cfg, tx, schedule, teacher_model=teacher_of(model))
    example = local_batch(0)
    batch_sh = {k: parallel.batch_sharding(mesh, v.ndim) for k, v in example.items()}
    p_step = jit_train_step(train_step, state_sh, teacher_sh, batch_sh, parallel.replicated(mesh))
    rng = jax.random.key(config.seed)

    # --- loop; metrics are fetched one step late so the host never waits on the device.
    writer = MetricWriter(workdir)
    start = int(state.step)
    pending, last = None, {}
    t_last = time.perf_counter()
    tokens_per_step = config.global_batch_size * config.max_len
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        for step in range(start, config.num_train_steps):
            batch = parallel.global_batch(local_batch(step), mesh)
            state, metrics = p_step(state, teacher, batch, rng)
            if pending is not None:
                last = _report(pending, writer, config, t_last, tokens_per_step)
                t_last = time.perf_counter()
            pending = (step + 1, metrics)
        if pending is not None:
            last = _report(pending, writer, config, t_last, tokens_per_step, force=True)
    return {"state": state, "metrics": last, "model": model}


def _report(pending, writer: MetricWriter, config, t_last: float, tokens_per_step: int, force: bool = False):
    step, metrics = pending
    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not math.isfinite(host["loss"]):
        raise NonFiniteLossError(
            f"non-finite loss {host['loss']} at step {step} (mlm_loss={host.get('mlm_loss')}, "
            f"tacl_loss={host.get('tacl_loss')}, grad_norm={host.get('grad_norm')}); lower "
            "optim.learning_rate, check the data, or use model.dtype=float32")
    if force or step % config.log_every == 0 or step == 1:
        dt = time.perf_counter() - t_last
        host["tokens_per_s"] = tokens_per_step / dt if dt > 0 else 0.0
        writer.write(step, host, config.num_train_steps)
    return host
