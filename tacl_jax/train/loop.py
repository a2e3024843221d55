"""The training loop, read top to bottom: start-up → mesh → model → state → input → step → loop.

``train_and_evaluate(config, workdir)`` is what ``python -m tacl_jax.main`` runs.
"""

from __future__ import annotations

import glob
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

from tacl_jax import checkpoint, hf, parallel, precision, tokens
from tacl_jax import config as config_lib
from tacl_jax import data as data_lib
from tacl_jax.flops import peak_flops_per_device, step_flops
from tacl_jax.models import BertConfig, BertModel, to_dtype
from tacl_jax.objectives import mask_tokens, objective_sums, ratios
from tacl_jax.objectives.coco_lm import coco_ratios
from tacl_jax.train import coco_step
from tacl_jax.train.optimizer import make_optimizer
from tacl_jax.train.state import TrainState
from tacl_jax.train.step import StepConfig, make_train_step, step_config_from, student_forward

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- model

def _bert_config(config, architecture: BertConfig | None) -> BertConfig:
    numerics = dict(dtype=precision.resolve_compute_dtype(config.model.dtype), param_dtype=config.model.param_dtype,
                    remat_policy=config.model.remat_policy, vocab_multiple=config.model.vocab_multiple,
                    # .get: configs saved in checkpoints before the key existed (tacl_jax.convert)
                    scan_layers=bool(config.model.get("scan_layers", False)),
                    hidden_dropout_prob=config.model.hidden_dropout_prob,
                    attention_probs_dropout_prob=config.model.attention_probs_dropout_prob,
                    dropout_bits=int(config.model.get("dropout_bits", 16)),
                    with_nsp_head=bool(config.nsp), with_pooler=True, with_mlm_head=True)
    if architecture is not None:
        return architecture.replace(**numerics)
    return BertConfig(**dict(config.init.scratch), **numerics)


def model_from_config(config) -> BertModel:
    """The student's module alone: the architecture of ``init.hf_path`` (its config.json) or
    ``init.scratch``, the numerics of ``config.model``. Reads no weights."""
    arch = hf.read_config(config.init.hf_path) if config.init.hf_path else None
    return BertModel(_bert_config(config, arch))


def build_model(config) -> tuple[BertModel, dict | None]:
    """The student's module and, when ``init.hf_path`` is set, its pretrained params (numpy)."""
    if config.init.hf_path:
        cfg = _bert_config(config, hf.read_config(config.init.hf_path))
        overrides = {f: getattr(cfg, f) for f in ("dtype", "param_dtype", "remat_policy", "scan_layers", "vocab_multiple",
                                                  "hidden_dropout_prob", "attention_probs_dropout_prob",
                                                  "dropout_bits", "with_nsp_head", "with_pooler", "with_mlm_head")}
        return hf.load(config.init.hf_path, seed=config.seed, **overrides)
    return model_from_config(config), None


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

def _init_params_fn(model: BertModel, max_len: int):
    def init_params(rng):
        return model.init(rng, jnp.zeros((1, max_len), jnp.int32))["params"]
    return init_params


def state_shardings(model: BertModel, tx, mesh, rules, max_len: int):
    """``(abstract TrainState with shardings, TrainState of shardings)`` without allocating."""
    init_params = _init_params_fn(model, max_len)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_params, jax.random.key(0))
        param_sh = parallel.logical_shardings(abstract_boxed, mesh, rules)
        # Plain unboxing: ``nn.meta.unbox`` would place sharding constraints on abstract values.
        abstract_params = jax.tree.map(lambda x: x.unbox(apply_constraint=False), abstract_boxed,
                                       is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
        opt_sh = _optimizer_shardings(tx, abstract_opt, param_sh, parallel.replicated(mesh))
    repl = parallel.replicated(mesh)
    shardings = TrainState(step=repl, params=param_sh, opt_state=opt_sh)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt)
    return checkpoint.abstract_like(abstract, shardings), shardings


def create_state(model: BertModel, tx, mesh, rules, seed: int, max_len: int, init_params=None):
    """The student's ``TrainState`` created sharded, and its shardings.

    From scratch the params are initialised on device already sharded (no host holds them all);
    from a checkpoint every process places its shards of the host copy.
    """
    abstract, shardings = state_shardings(model, tx, mesh, rules, max_len)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        if init_params is None:
            init = _init_params_fn(model, max_len)
            params = jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=shardings.params)(jax.random.key(seed))
        else:
            expected = jax.tree.map(lambda a: tuple(a.shape), abstract.params)
            got = jax.tree.map(lambda a: tuple(a.shape), init_params)
            if jax.tree.structure(expected) != jax.tree.structure(got) or expected != got:
                raise ValueError("the initial parameter tree does not match the model built from the config "
                                 "(different heads or shapes)")
            params = parallel.place(init_params, shardings.params)
        opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params=params,
                       opt_state=opt_state)
    return state, shardings


def _optimizer_shardings(tx, abstract_opt, param_sh, repl):
    """Optimizer-state leaves that mirror a parameter get its sharding; counters are replicated."""
    import optax

    return optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                 transform_non_params=lambda _: repl,
                                 is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def create_teacher(student_params, param_sh, dtype: str, compute_dtype=None):
    """A frozen copy of the student's encoder in fresh buffers (the student's are donated every step).

    ``dtype``: 'float32' / 'bfloat16' store every leaf so; 'compute' stores the matmul kernels in
    ``compute_dtype`` (the model's resolved compute dtype) and the rest (embeddings, LayerNorm,
    biases) as they are. The Dense layers cast their kernel to the compute dtype before every
    matmul, so 'compute' gives bit-identical teacher outputs while the per-step cast of the
    teacher's ~all weights disappears (and, in bf16, half their memory)."""
    enc, enc_sh = strip_heads(student_params), strip_heads(param_sh)
    if dtype == "compute" and compute_dtype is None:
        raise ValueError("create_teacher(dtype='compute') needs the model's compute_dtype")
    dt = to_dtype(compute_dtype if dtype == "compute" else dtype)

    def cast(path, x):
        if dtype == "compute" and getattr(path[-1], "key", None) != "kernel":
            return x + 0
        return x.astype(dt) if x.dtype != dt else x + 0
    copy = jax.jit(lambda p: jax.tree_util.tree_map_with_path(cast, p), out_shardings=enc_sh)
    return copy(enc), enc_sh


def initial_params(model: BertModel, mesh, rules, seed: int, max_len: int, shardings, hf_params=None):
    """The run's starting params (sharded): the HF checkpoint's, or the seed's initialisation —
    a pure function of the seed, so a resumed run rebuilds the same teacher."""
    if hf_params is not None:
        return parallel.place(hf_params, shardings)
    init = _init_params_fn(model, max_len)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=shardings)(jax.random.key(seed))


# ----------------------------------------------------------------------------- metrics

def local_dir(workdir: str) -> str:
    """Where files that need a POSIX filesystem (appended JSONL, TensorBoard events, the export
    staging) go: the workdir itself, or for a remote one (``gs://...``) a local mirror,
    ``$TACL_LOCAL_DIR`` or ``/tmp/tacl_jax/<bucket path>``. Checkpoints go to the workdir either way."""
    if "://" not in workdir:
        return workdir
    root = os.environ.get("TACL_LOCAL_DIR", os.path.join("/tmp", "tacl_jax"))
    return os.path.join(root, workdir.split("://", 1)[1].strip("/"))


def _copy_tree(src: str, dst: str) -> None:
    """Local folder -> remote folder (``gs://``) through etils/epath, subfolders included."""
    from etils import epath

    dst_path = epath.Path(dst)
    dst_path.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(src):
        if os.path.isdir(os.path.join(src, f)):
            _copy_tree(os.path.join(src, f), str(dst_path / f))
        else:
            (dst_path / f).write_bytes(open(os.path.join(src, f), "rb").read())


class MetricWriter:
    """Console line, ``metrics.jsonl`` and TensorBoard events in the workdir (its local mirror
    when the workdir is remote), from process 0 only."""

    def __init__(self, workdir: str):
        self.enabled = jax.process_index() == 0
        target = local_dir(workdir)
        self.path = os.path.join(target, "metrics.jsonl")
        self.tb = None
        if self.enabled:
            if target != workdir:
                log.info("remote workdir %s: metrics.jsonl and TensorBoard events go to %s", workdir, target)
            os.makedirs(target, exist_ok=True)
            workdir = target
            try:
                from tensorboardX import SummaryWriter
                self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            except ImportError:  # optional: JSONL and console still work
                log.info("tensorboardX not installed: no TensorBoard events")

    def write(self, step: int, metrics: dict[str, float], total_steps: int, prefix: str = "") -> None:
        if not self.enabled:
            return
        row = {"step": step, **{prefix + k: v for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        keys = [k for k in ("loss", "mlm_loss", "mlm_acc", "tacl_loss", "tacl_acc", "nsp_loss", "mlm_perplexity",
                            "gen_mlm_loss", "binary_loss", "binary_acc", "clm_loss", "scl_loss", "scl_acc",
                            "grad_norm", "lr") if k in metrics]
        shown = " ".join(f"{prefix}{k}={metrics[k]:.4g}" for k in keys)
        extra = ""
        if "tokens_per_s" in metrics:
            extra = f" tok/s={metrics['tokens_per_s']:,.0f}"
            if metrics.get("mfu"):
                extra += f" mfu={metrics['mfu']:.1%}"
            if metrics.get("eta_s") is not None:
                extra += f" eta={metrics['eta_s'] / 60:.1f}min"
        bar = _progress_bar(step, total_steps)
        log.info("%s step %d/%d %s%s", bar, step, total_steps, shown, extra)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _progress_bar(step: int, total: int, width: int = 20) -> str:
    done = int(width * step / max(total, 1))
    return "[" + "#" * done + "." * (width - done) + "]"


# ----------------------------------------------------------------------------- profiling

class _Profiler:
    """``config.profile_steps='START,STOP'``: a ``jax.profiler`` trace of the steps that take the
    state from step START to step STOP, on process 0, in ``workdir/profile/`` (written to the local
    mirror and copied for a remote workdir). The trace starts before step START is dispatched and
    stops once the last profiled step's outputs are ready (so its device work is in the trace) —
    at STOP, or earlier when the run ends, pauses or is preempted inside the window (``last``);
    ``close()`` stops a trace an exception left open. A resumed run traces what is left of the window."""

    def __init__(self, config, workdir: str, start_step: int):
        window = config_lib.parse_profile_steps(config.get("profile_steps", ""))
        self.window = window if jax.process_index() == 0 else None
        self.workdir, self.local = workdir, os.path.join(local_dir(workdir), "profile")
        self.active, self.first = False, None
        if self.window is not None and start_step >= self.window[1]:
            log.info("profile_steps=%r: this run starts at step %d, after the window; no trace",
                     config.profile_steps, start_step)
            self.window = None

    def before_step(self, step: int) -> None:
        if self.window is None or self.active or step < self.window[0]:
            return
        os.makedirs(self.local, exist_ok=True)
        try:
            jax.profiler.start_trace(self.local, create_perfetto_trace=True)
        except RuntimeError:  # e.g. another trace is running in this process: train on, untraced
            log.exception("profile: could not start the trace; the run goes on without it")
            self.window = None
            return
        self.active, self.first = True, step

    def after_step(self, done: int, outputs, last: bool) -> None:
        if self.active and (done >= self.window[1] or last):
            self.stop(done, outputs)

    def close(self) -> None:
        """After an exception inside the window: stop the trace, never masking that exception."""
        if self.active:
            try:
                self.stop(None, None)
            except Exception:  # pylint: disable=broad-except
                log.exception("profile: saving the interrupted trace failed")

    def stop(self, done: int | None, outputs) -> None:
        self.active, self.window = False, None
        try:
            if outputs is not None:
                jax.block_until_ready(outputs)   # the profiled steps' device work, inside the trace
        finally:
            stopped = self._stop_trace()
        if not stopped:
            return
        target = os.path.join(self.workdir, "profile")
        if target != self.local:
            try:
                _copy_tree(self.local, target)
            except Exception:  # pylint: disable=broad-except
                log.exception("profile: copying the trace to %s failed; it is in %s", target, self.local)
                target = self.local
        perfetto = sorted(glob.glob(os.path.join(self.local, "plugins", "profile", "*", "perfetto_trace.json.gz")),
                          key=os.path.getmtime)
        perfetto_path = perfetto[-1].replace(self.local, target, 1) if perfetto else "(not written)"
        steps = (f"training steps {self.first + 1}..{done} (state step {self.first} -> {done})" if done is not None
                 else f"training from state step {self.first} until an error")
        log.info("profile: %s traced -> %s; view with `tensorboard --logdir %s` (Profile tab; pip install "
                 "tensorboard-plugin-profile) or `xprof --logdir %s`, or open %s at https://ui.perfetto.dev",
                 steps, target, target, target, perfetto_path)

    @staticmethod
    def _stop_trace() -> bool:
        try:
            jax.profiler.stop_trace()
            return True
        except Exception:  # pylint: disable=broad-except  # a failed trace must not end training
            log.exception("profile: stopping the trace failed; the run goes on")
            return False


# ----------------------------------------------------------------------------- evaluation

def make_eval_step(model: BertModel, step_cfg: StepConfig, teacher_model: BertModel):
    """Deterministic forward on held-out batches with a fixed mask key: the loss sums, so numbers
    compare across runs and steps."""
    def eval_step(params, teacher_params, batch, rng):
        masked = mask_tokens(rng, batch["input_ids"], batch["attention_mask"],
                             max_predictions=step_cfg.max_predictions, mask_id=step_cfg.mask_id,
                             vocab_size=model.config.vocab_size, special_ids=step_cfg.special_ids,
                             mask_prob=step_cfg.mask_prob, replace_prob=step_cfg.replace_prob,
                             random_prob=step_cfg.random_prob,
                             word_starts=batch.get("word_starts") if step_cfg.whole_word else None)
        out = student_forward(model, step_cfg, params, masked.input_ids, batch["attention_mask"],
                              batch["token_type_ids"], masked.positions, deterministic=True)
        teacher_hidden = None
        if teacher_params is not None:
            teacher_hidden = teacher_model.apply({"params": teacher_params}, batch["input_ids"],
                                                 batch["attention_mask"], batch["token_type_ids"],
                                                 deterministic=True, heads=False).last_hidden_state
        return objective_sums(mlm_logits=out.mlm_logits, masked=masked, student_hidden=out.last_hidden_state,
                              teacher_hidden=teacher_hidden,
                              key_mask=batch["attention_mask"] if step_cfg.mask_pad_keys else None,
                              temperature=step_cfg.temperature, student_at_slots=step_cfg.gather_last_layer)
    return eval_step


def evaluate(p_eval, params, teacher, batches, mesh, seed: int, to_ratios=ratios) -> dict[str, float]:
    total: dict[str, float] = {}
    for i, local in enumerate(batches):
        sums = jax.device_get(p_eval(params, teacher, parallel.global_batch(local, mesh),
                                     jax.random.fold_in(jax.random.key(seed), i)))
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + float(v)
    out = {k: float(v) for k, v in to_ratios(total).items()}
    if "mlm_loss" in out:
        out["mlm_perplexity"] = float(math.exp(min(out["mlm_loss"], 50.0)))
    return out


# ----------------------------------------------------------------------------- main loop

def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
    """Train per ``config`` in ``workdir`` (resuming from its latest checkpoint when there is one).

    Returns ``{"state", "metrics" (the last logged), "model", "status"}``; status is
    ``finished`` | ``preempted`` | ``paused`` (``steps_per_run`` reached) | ``already_finished``.
    """
    # --- start-up
    parallel.maybe_initialize_distributed(config.distributed)
    config_lib.validate(config)
    workdir = os.path.abspath(workdir) if "://" not in workdir else workdir
    rules = parallel.rules_from_config(config.logical_axis_rules)

    # --- mesh
    devices = jax.devices()[:config.mesh_devices] if config.mesh_devices > 0 else jax.devices()
    mesh = parallel.make_mesh(dict(config.mesh), devices)
    check_batch_arithmetic(config, mesh)
    log.info("mesh %s: %d process(es) × %d local device(s); global batch %d = %d per process, %d micro-batch(es)",
             dict(mesh.shape), jax.process_count(), jax.local_device_count(), config.global_batch_size,
             config.global_batch_size // jax.process_count(), config.grad_accum_steps)

    # --- model (COCO-LM: the generator, the main BERT and its heads in one parameter tree)
    coco = config.objective == "coco_lm"
    model, hf_params = coco_step.build_coco_model(config) if coco else build_model(config)
    check_model(config, model)
    tok_dir = config.init.tokenizer_path or config.init.hf_path
    special = tokens.run_special_ids(tok_dir, model.config.vocab_size)
    step_cfg = coco_step.coco_step_config_from(config, special, mesh) if coco else step_config_from(config, special)
    tx, schedule = make_optimizer(config.optim, config.num_train_steps)
    abstract_state, state_sh = state_shardings(model, tx, mesh, rules, config.max_len)

    # --- input (before the checkpoint folder exists: a refused data config leaves nothing behind)
    data_kwargs = dict(global_batch_size=config.global_batch_size, max_len=config.max_len, seed=config.seed,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       tokenizer_dir=tok_dir or None, vocab_size=model.config.vocab_size,
                       special_ids=special, with_nsp=config.nsp)
    train_iter = data_lib.make_train_iterator(config.data, **data_kwargs)
    eval_batches = []
    if config.eval_every > 0 or config.eval_at_end:
        eval_batches = data_lib.make_eval_batches(config.data, num_batches=config.eval_batches, **data_kwargs)

    # --- state: this workdir's checkpoint → init.hf_path → init.params_from → from scratch.
    # Every start-up check above has passed: only now is workdir/checkpoints created.
    ckpt = checkpoint.CheckpointManager(workdir, config.checkpoint)
    latest = ckpt.latest_step()
    data_state = None
    if latest is not None:
        log.info("start-up: resuming from %s/%d", ckpt.directory, latest)
        state, data_state, _ = ckpt.restore(latest, abstract_state)
        if latest >= config.num_train_steps:
            log.info("this run already finished: step %d of %d is checkpointed in %s; nothing to do",
                     latest, config.num_train_steps, ckpt.directory)
            ckpt.close()
            train_iter.close()
            return {"state": state, "metrics": {}, "model": model, "status": "already_finished"}
    elif config.init.hf_path:
        log.info("start-up: no checkpoint in %s; student and teacher from the Hugging Face checkpoint %s",
                 ckpt.directory, config.init.hf_path)
        if coco:
            state, _ = coco_step.create_coco_state(model, tx, mesh, rules, config.seed, config.max_len, hf_params)
        else:
            state, _ = create_state(model, tx, mesh, rules, config.seed, config.max_len, hf_params)
    elif config.init.params_from:
        other = checkpoint.CheckpointManager(config.init.params_from, config.checkpoint)
        step_other = other.latest_step()
        if step_other is None:
            raise FileNotFoundError(f"init.params_from={config.init.params_from!r} has no complete checkpoint")
        log.info("start-up: no checkpoint in %s; params from %s/%d (optimizer state and step reset)",
                 ckpt.directory, other.directory, step_other)
        restored, _, _ = other.restore(step_other, abstract_state)
        other.close()
        state, _ = create_state(model, tx, mesh, rules, config.seed, config.max_len,
                                jax.device_get(restored.params))
        hf_params = jax.device_get(restored.params)
    else:
        log.info("start-up: no checkpoint in %s and no init.hf_path: from scratch (seed %d)",
                 ckpt.directory, config.seed)
        state, _ = create_state(model, tx, mesh, rules, config.seed, config.max_len)
    start = int(jax.device_get(state.step))

    teacher, teacher_sh = None, None
    if not coco and step_cfg.uses_teacher:
        init = initial_params(model, mesh, rules, config.seed, config.max_len, state_sh.params, hf_params)
        teacher, teacher_sh = create_teacher(init, state_sh.params, config.tacl.teacher_param_dtype,
                                             model.config.dtype)
        del init
    del hf_params
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    log.info("model: %d layers, hidden %d, vocab %d (padded %d), compute %s, %.2fM params; objective %s",
             model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size,
             model.config.padded_vocab_size, model.config.dtype, n_params / 1e6, config.objective)

    # --- input, at the restored step
    if data_state is not None:
        train_iter.set_state(data_state)
    if train_iter.step != start:
        raise checkpoint.CheckpointError(f"the data iterator is at step {train_iter.step} but the "
                                         f"train state at step {start}: the checkpoint is inconsistent")

    # --- step
    if coco:
        train_step = coco_step.make_coco_train_step(model, step_cfg, tx, schedule)
        eval_step, eval_ratios = coco_step.make_coco_eval_step(model, step_cfg), coco_ratios
        flops = coco_step.coco_step_flops(model, step_cfg, batch=config.global_batch_size, length=config.max_len)
    else:
        teacher_model = teacher_of(model)
        train_step = make_train_step(model, step_cfg, tx, schedule, teacher_model=teacher_model)
        eval_step, eval_ratios = make_eval_step(model, step_cfg, teacher_model), ratios
        flops = step_flops(model.config, batch=config.global_batch_size, length=config.max_len,
                           predictions=step_cfg.max_predictions, teacher=step_cfg.uses_teacher,
                           gathered_last_layer=step_cfg.gather_last_layer)
    batch_sh = None  # inferred from the global arrays (rows over data × fsdp)
    p_step = jax.jit(train_step, in_shardings=(state_sh, teacher_sh, batch_sh, parallel.replicated(mesh)),
                     out_shardings=(state_sh, parallel.replicated(mesh)), donate_argnums=(0,))
    p_eval = jax.jit(eval_step)
    rng = jax.random.key(config.seed)
    export_model = model.main if coco else model

    def export_params(params):  # what goes into a Hugging Face folder: the (main) BERT
        return params["main"] if coco else params
    peak = peak_flops_per_device(config.metrics.peak_flops_per_device)

    # --- loop; metrics are fetched one step late so the host never waits on the device.
    writer = MetricWriter(workdir)
    preempt = checkpoint.PreemptionFlag().install()
    pending, last, status = None, {}, "finished"
    timer = _Timer(start)
    profiler = _Profiler(config, workdir, start)
    step = start
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            for step in range(start, config.num_train_steps):
                batch = parallel.global_batch(next(train_iter), mesh)
                profiler.before_step(step)
                state, metrics = p_step(state, teacher, batch, rng)
                if step == start:
                    timer.compiled()
                if pending is not None:
                    last = _report(pending, writer, config, timer, flops, peak) or last
                pending = (step + 1, metrics)
                done = step + 1
                preempted = preempt.is_set() or ckpt.reached_preemption(done)
                stop_here = config.steps_per_run > 0 and done - start >= config.steps_per_run
                profiler.after_step(done, (state, metrics),
                                    last=preempted or stop_here or done == config.num_train_steps)
                if preempted or stop_here or ckpt.should_save(done) or done == config.num_train_steps:
                    ckpt.save(done, state, train_iter.get_state(), config, force=True)
                if config.hf_export_every > 0 and done % config.hf_export_every == 0:
                    _export(export_model, export_params(state.params), workdir, f"step_{done}", tok_dir)
                if config.eval_every > 0 and done % config.eval_every == 0 and eval_batches:
                    writer.write(done, evaluate(p_eval, state.params, teacher, eval_batches, mesh, config.seed + 1, eval_ratios),
                                 config.num_train_steps, prefix="eval_")
                if preempted:
                    status = "preempted"
                    log.warning("preempted: checkpoint of step %d is being written; exiting cleanly", done)
                    break
                if stop_here and done < config.num_train_steps:
                    status = "paused"
                    log.info("steps_per_run=%d reached at step %d: checkpointed; rerun to continue",
                             config.steps_per_run, done)
                    break
            if pending is not None:
                last = _report(pending, writer, config, timer, flops, peak, force=True) or last
            evaluated_last = config.eval_every > 0 and step + 1 == config.num_train_steps and \
                config.num_train_steps % config.eval_every == 0
            if status == "finished" and config.eval_at_end and eval_batches and not evaluated_last:
                writer.write(config.num_train_steps, evaluate(p_eval, state.params, teacher, eval_batches, mesh,
                                                              config.seed + 1, eval_ratios), config.num_train_steps, prefix="eval_")
            if status == "finished" and config.export_at_end:
                _export(export_model, export_params(state.params), workdir, "final", tok_dir)
    finally:
        profiler.close()
        ckpt.wait()
        ckpt.close()
        preempt.uninstall()
        writer.close()
        train_iter.close()
    if status == "finished" and config.analysis.enabled and jax.process_index() == 0:
        try:
            analyze_at_end(config, workdir, export_model.config.max_position_embeddings)
        except Exception:  # pylint: disable=broad-except  # the run is complete and saved either way
            log.exception("analysis failed (training, checkpoint and export are complete); rerun it with "
                          "python -m tacl_jax.analyze --workdir=%s --split=heldout --out=...", workdir)
    return {"state": state, "metrics": last, "model": model, "status": status}


def analyze_at_end(config, workdir: str, max_position_embeddings: int) -> dict | None:
    """The TaCL paper's isotropy analysis of the final export (and of ``init.hf_path`` with
    ``analysis.compare_init``) on held-out sentences: ``workdir/analysis/self_similarity.json``,
    ``self_similarity.png`` and ``cosine_heatmap.png``, and one log line. Skipped, with a log line
    saying why, when there is no export or no held-out text. Returns the report (None if skipped)."""
    from tacl_jax import analyze

    ac = config.analysis
    export = export_dir(local_dir(workdir), "final")
    if not config.export_at_end or not os.path.isdir(export):
        log.info("analysis skipped: it reads the final Hugging Face export (config.export_at_end=True)")
        return None
    try:
        sentences, source = analyze.heldout_sentences(config.data, max_sentences=ac.num_sentences,
                                                      seed=config.seed, scan_limit=20 * ac.num_sentences)
    except analyze.NoSentences as e:
        log.info("analysis skipped: no held-out sentences (%s)", e)
        return None
    t0 = time.perf_counter()
    entries = []
    if ac.compare_init and config.init.hf_path:
        entries.append(analyze.load_entry(config.init.hf_path, "init"))
    entries.append(analyze.load_entry(export, f"after {config.num_train_steps} steps ({config.objective})"))
    out = os.path.join(local_dir(workdir), "analysis")
    report = analyze.run_analysis(entries, sentences, out, max_len=min(ac.max_len, max_position_embeddings),
                                  batch_size=ac.batch_size, corpus=f"{source} (held-out)")
    if out != os.path.join(workdir, "analysis"):
        _copy_tree(out, os.path.join(workdir, "analysis"))
    run = report["models"][-1]["last_layer"]
    init = f" (init {report['models'][0]['last_layer']:.4f})" if len(entries) > 1 else ""
    log.info("analysis: last-layer self-similarity %.4f%s on %d held-out sentences, %.0fs -> %s "
             "(self_similarity.json, self_similarity.png, cosine_heatmap.png)", run, init, len(sentences),
             time.perf_counter() - t0, os.path.join(workdir, "analysis"))
    return report


def export_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "export", name)


def _export(model, params, workdir: str, name: str, tok_dir: str | None) -> None:
    out = export_dir(workdir, name)
    staging = export_dir(local_dir(workdir), name)
    hf.save(model, params, staging, head="mlm", tokenizer_from=tok_dir or None)
    if staging != out and jax.process_index() == 0:
        _copy_tree(staging, out)
    log.info("exported the student as a Hugging Face BertForMaskedLM folder: %s", out)


class _Timer:
    """Step time, compile time and ETA from host timestamps between reports."""

    def __init__(self, start_step: int):
        self.t0 = time.perf_counter()
        self.compile_s = None
        self.t_last, self.step_last = None, start_step

    def compiled(self):
        # The first dispatch returns once the step is compiled (execution is asynchronous).
        self.compile_s = time.perf_counter() - self.t0


def _report(pending, writer: MetricWriter, config, timer: _Timer, flops: float, peak: float | None,
            force: bool = False):
    step, metrics = pending
    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not math.isfinite(host["loss"]):
        raise NonFiniteLossError(
            f"non-finite loss {host['loss']} at step {step} ("
            + ", ".join(f"{k}={v:.4g}" for k, v in host.items() if k.endswith("_loss") or k == "grad_norm")
            + "); lower "
            "optim.learning_rate, check the data, or use model.dtype=float32")
    now = time.perf_counter()
    if not (force or step % config.log_every == 0 or step == 1):
        return host
    if timer.t_last is not None and step > timer.step_last:
        dt = (now - timer.t_last) / (step - timer.step_last)
        n_dev = jax.device_count()
        host.update(step_time_s=dt, tokens_per_s=config.global_batch_size * config.max_len / dt,
                    tokens_per_s_per_device=config.global_batch_size * config.max_len / dt / n_dev,
                    tflops_per_device=flops / dt / n_dev / 1e12,
                    eta_s=dt * (config.num_train_steps - step))
        if peak:
            host["mfu"] = flops / dt / n_dev / peak
    if timer.compile_s is not None:
        host["compile_s"] = timer.compile_s
    timer.t_last, timer.step_last = now, step
    writer.write(step, host, config.num_train_steps)
    return host
