"""The one builder of the jitted train step: config + devices -> the program and its abstract inputs.

``build_program(config, devices)`` is what the training loop, ``python -m tacl_jax.aot`` and the
benches call, so they compile the same program. It does no device work: the model, the optimizer,
the shardings and the abstract state/teacher/batch come from ``jax.eval_shape`` and the config, so
``devices`` may be real or compile-only (a TPU topology described on a CPU host). Everything that
depends on the hardware is decided here, once, from the platform of those devices (never from the
host): the compute dtype ``model.dtype='auto'``, the model's kernel family (``BertConfig.kernels``),
the number of hosts (their process indices) and the peak FLOP/s (their device kind).

What the objective decides (the student module around the BERT, the step, the teacher, the
FLOPs) comes from its entry in ``tacl_jax.train.objective``; nothing here branches on the
objective. Also here: creating the sharded state and the frozen teacher (the loop's start-up;
``convert`` and the benches use them too).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from tacl_jax import checkpoint, hf, parallel, precision, tokens
from tacl_jax.errors import ConfigError
from tacl_jax.flops import peak_flops_of_kind
from tacl_jax.models import BertConfig, to_dtype
from tacl_jax.train import objective as objective_lib
from tacl_jax.train.optimizer import make_optimizer
from tacl_jax.train.state import TrainState

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the target

@dataclasses.dataclass(frozen=True)
class Target:
    """What the program is compiled for: ``platform`` ('cpu' | 'tpu' | 'gpu'), the devices' kind
    (e.g. 'TPU v4'), how many devices and how many hosts (distinct process indices)."""

    platform: str
    device_kind: str
    num_devices: int
    num_processes: int

    @classmethod
    def of(cls, devices: Sequence[Any]) -> "Target":
        devices = list(devices)
        if not devices:
            raise ValueError("no devices to build the step for")
        return cls(platform=precision.platform_of(devices), device_kind=devices[0].device_kind,
                   num_devices=len(devices), num_processes=len({d.process_index for d in devices}))


def run_devices(config) -> list:
    """This run's real devices: all of them, or the first ``config.mesh_devices``."""
    devices = jax.devices()
    return devices[:config.mesh_devices] if config.mesh_devices > 0 else devices


# ----------------------------------------------------------------------------- model

def bert_config(config, architecture: BertConfig | None, platform: str) -> BertConfig:
    """The student's ``BertConfig``: the architecture (``init.hf_path``'s, given, or
    ``init.scratch``) with the numerics of ``config.model`` resolved for ``platform``."""
    dtype = precision.resolve_compute_dtype(config.model.dtype, platform)
    numerics = dict(dtype=dtype, param_dtype=config.model.param_dtype,
                    remat_policy=config.model.remat_policy, vocab_multiple=config.model.vocab_multiple,
                    # .get: configs saved in checkpoints before the key existed (tacl_jax.convert)
                    scan_layers=bool(config.model.get("scan_layers", False)),
                    hidden_dropout_prob=config.model.hidden_dropout_prob,
                    attention_probs_dropout_prob=config.model.attention_probs_dropout_prob,
                    dropout_bits=int(config.model.get("dropout_bits", 16)),
                    kernels=precision.kernels_for(platform),
                    with_nsp_head=bool(config.nsp), with_pooler=True, with_mlm_head=True)
    if architecture is not None:
        return architecture.replace(**numerics)
    return BertConfig(**dict(config.init.scratch), **numerics)


def _default_platform() -> str:
    return precision.platform_of(jax.devices()[:1])


def model_from_config(config, platform: str | None = None, architecture: BertConfig | None = None):
    """The run's student module (the objective's: ``BertModel`` for TaCL/MLM, ``CocoLM`` for
    COCO-LM): the architecture of ``init.hf_path`` (its config.json; or ``architecture``) or
    ``init.scratch``, the numerics of ``config.model`` for ``platform`` (default: this process's
    devices). Reads no weights."""
    platform = platform or _default_platform()
    if architecture is None and config.init.hf_path:
        architecture = hf.read_config(config.init.hf_path)
    return objective_lib.get(config.objective).build_model(config, bert_config(config, architecture, platform))


def hf_params_for(config, model) -> dict | None:
    """The pretrained params (numpy) of ``init.hf_path`` for the BERT inside ``model`` (its heads
    that the checkpoint lacks initialised from the seed), or None without an ``hf_path``."""
    if not config.init.hf_path:
        return None
    cfg = objective_lib.bert_of(objective_lib.get(config.objective), model).config
    # Every field of the model's config: the checkpoint's architecture (read from the same
    # config.json) with the run's numerics and heads.
    _, params = hf.load(config.init.hf_path, seed=config.seed,
                        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    return params


def build_model(config, platform: str | None = None) -> tuple[Any, dict | None]:
    """The student's module and, when ``init.hf_path`` is set, its BERT's pretrained params (numpy)."""
    model = model_from_config(config, platform)
    return model, hf_params_for(config, model)


def strip_heads(params: dict) -> dict:
    """The teacher's params in a student's BERT params: the encoder without heads."""
    return {k: v for k, v in params.items() if k in ("embeddings", "encoder")}


# ----------------------------------------------------------------------------- checks

def check_batch_arithmetic(config, mesh) -> None:
    """Global batch vs hosts vs data-parallel devices vs accumulation, with the fix. Hosts are
    the mesh's distinct process indices (a compile-only topology's too)."""
    b, k = config.global_batch_size, config.grad_accum_steps
    dp = parallel.data_parallel_size(mesh)
    procs = len({d.process_index for d in mesh.devices.flat})
    if b % procs:
        raise ConfigError(f"global_batch_size {b} is not divisible by the {procs} processes (hosts); "
                         f"use a multiple of {procs}")
    if b % dp:
        raise ConfigError(f"global_batch_size {b} is not divisible by the data-parallel size {dp} "
                         f"(mesh data×fsdp); use a multiple of {dp} or change config.mesh")
    if (b // k) % dp:
        raise ConfigError(f"a micro-batch of {b // k} (global_batch_size {b} / grad_accum_steps {k}) is not "
                         f"divisible by the data-parallel size {dp}; lower grad_accum_steps")


def check_model(config, model) -> None:
    cfg = model.config
    if config.max_len > cfg.max_length:
        # RoBERTa's positions start at pad_token_id + 1 (BertConfig.max_length): 514 rows, 512 tokens.
        less = (f" less RoBERTa's pad_token_id + 1 = {cfg.max_length}"
                if cfg.max_length != cfg.max_position_embeddings else "")
        raise ConfigError(f"max_len {config.max_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}{less}; lower config.max_len")


def host_rows(mesh, global_batch_size: int) -> dict[int, list[int]]:
    """``{process index: the global batch rows its devices hold}`` under the batch sharding: what
    each host must feed (``parallel.global_batch`` takes ``B / hosts`` rows per process)."""
    sh = parallel.batch_sharding(mesh, 2)
    rows: dict[int, set[int]] = {}
    for d, idx in sh.devices_indices_map((global_batch_size, 1)).items():
        r = range(global_batch_size)[idx[0]]
        rows.setdefault(d.process_index, set()).update(r)
    return {p: sorted(r) for p, r in sorted(rows.items())}


# ----------------------------------------------------------------------------- state

def _init_params_fn(model, max_len: int):
    def init_params(rng):
        return model.init(rng, jnp.zeros((1, max_len), jnp.int32))["params"]
    return init_params


def abstract_key(sharding=None) -> jax.ShapeDtypeStruct:
    """A PRNG key's shape and dtype (traced, never made on a device: compile-only meshes refuse that)."""
    return jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=sharding)


def param_shardings(model, mesh, rules, max_len: int):
    """``(abstract params, their shardings)`` of ``model`` under the logical-axis ``rules``, without
    allocating."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(_init_params_fn(model, max_len), abstract_key())
        param_sh = parallel.logical_shardings(abstract_boxed, mesh, rules)
        # Plain unboxing: ``nn.meta.unbox`` would place sharding constraints on abstract values.
        abstract_params = jax.tree.map(lambda x: x.unbox(apply_constraint=False), abstract_boxed,
                                       is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    return abstract_params, param_sh


def state_shardings(model, tx, mesh, rules, max_len: int):
    """``(abstract TrainState with shardings, TrainState of shardings)`` without allocating."""
    abstract_params, param_sh = param_shardings(model, mesh, rules, max_len)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
    repl = parallel.replicated(mesh)
    # Outside the mesh: optax inits placeholders eagerly (scalar counters), which a compile-only
    # mesh would refuse.
    opt_sh = _optimizer_shardings(tx, abstract_opt, param_sh, repl)
    shardings = TrainState(step=repl, params=param_sh, opt_state=opt_sh)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt)
    return checkpoint.abstract_like(abstract, shardings), shardings


def create_state(model, tx, mesh, rules, seed: int, max_len: int, init_params=None, at: str | None = None):
    """The student's ``TrainState`` created sharded, and its shardings.

    From scratch the params are initialised on device already sharded (no host holds them all).
    ``init_params`` (a host copy, e.g. a Hugging Face BERT's) are placed shard by shard: the
    whole tree, or with ``at`` the subtree ``params[at]`` (the objective's ``bert_at``), the rest
    initialised from ``seed``.
    """
    abstract, shardings = state_shardings(model, tx, mesh, rules, max_len)
    if init_params is None or at is not None:
        params = seed_params(model, mesh, rules, seed, max_len, shardings.params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        if init_params is not None:
            target = abstract.params if at is None else abstract.params[at]
            expected = jax.tree.map(lambda a: tuple(a.shape), target)
            got = jax.tree.map(lambda a: tuple(a.shape), init_params)
            if jax.tree.structure(expected) != jax.tree.structure(got) or expected != got:
                raise ValueError("the initial parameter tree does not match the model built from the config "
                                 "(different heads or shapes)")
            if at is None:
                params = parallel.place(init_params, shardings.params)
            else:
                params = {**params, at: parallel.place(init_params, shardings.params[at])}
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


def _teacher_cast(dtype: str, compute_dtype) -> Callable:
    """The teacher's storage cast (see ``create_teacher``), a pure function of the encoder params."""
    if dtype == "compute" and compute_dtype is None:
        raise ValueError("create_teacher(dtype='compute') needs the model's compute_dtype")
    dt = to_dtype(compute_dtype if dtype == "compute" else dtype)

    def cast(path, x):
        if dtype == "compute" and getattr(path[-1], "key", None) != "kernel":
            return x + 0
        return x.astype(dt) if x.dtype != dt else x + 0
    return lambda p: jax.tree_util.tree_map_with_path(cast, p)


def create_teacher(student_params, param_sh, dtype: str, compute_dtype=None):
    """A frozen copy of the student's encoder in fresh buffers (the student's are donated every step).

    ``dtype``: 'float32' / 'bfloat16' store every leaf so; 'compute' stores the matmul kernels in
    ``compute_dtype`` (the model's resolved compute dtype) and the rest (embeddings, LayerNorm,
    biases) as they are. The Dense layers cast their kernel to the compute dtype before every
    matmul, so 'compute' gives bit-identical teacher outputs while the per-step cast of the
    teacher's ~all weights disappears (and, in bf16, half their memory)."""
    enc, enc_sh = strip_heads(student_params), strip_heads(param_sh)
    copy = jax.jit(_teacher_cast(dtype, compute_dtype), out_shardings=enc_sh)
    return copy(enc), enc_sh


def initial_params(model, mesh, rules, seed: int, max_len: int, shardings, hf_params=None):
    """The run's starting params (sharded): the HF checkpoint's, or the seed's initialisation —
    a pure function of the seed, so a resumed run rebuilds the same teacher."""
    if hf_params is not None:
        return parallel.place(hf_params, shardings)
    return seed_params(model, mesh, rules, seed, max_len, shardings)


def seed_params(model, mesh, rules, seed: int, max_len: int, shardings):
    """The model's initialisation from ``seed``, created on device already sharded (no host ever
    holds the whole tree)."""
    init = _init_params_fn(model, max_len)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=shardings)(jax.random.key(seed))


# ----------------------------------------------------------------------------- the program

@dataclasses.dataclass
class Program:
    """The jitted train step of a config on a list of devices, with everything around it.

    ``train_step(state, teacher, batch, rng) -> (state, metrics)`` is ``jax.jit``-ed with explicit
    in/out shardings and the state donated; ``abstract_*`` are ``ShapeDtypeStruct``s carrying those
    shardings (``lower()`` compiles without any array). ``teacher_model`` and ``teacher`` are None
    for objectives without one. ``batch_keys``: what the step reads of a batch (``global_batch``
    of those keys). ``eval_step(params, teacher, batch, rng) -> sums`` is jitted; ``eval_ratios``
    turns summed sums into metrics."""

    config: Any
    objective: Any                 # tacl_jax.train.objective.Objective
    target: Target
    mesh: Any
    rules: tuple
    model: Any
    teacher_model: Any
    step_cfg: Any
    tx: Any
    schedule: Callable
    special_ids: dict
    state_shardings: TrainState
    teacher_shardings: Any
    batch_shardings: dict
    abstract_state: TrainState
    abstract_teacher: Any
    abstract_batch: dict
    abstract_rng: Any
    train_step: Callable
    eval_step: Callable
    eval_ratios: Callable
    flops_per_step: float
    peak_flops_per_device: float | None
    teacher_dtype: str = "compute"

    @property
    def batch_keys(self) -> tuple[str, ...]:
        return tuple(self.abstract_batch)

    def lower(self):
        """``jax.stages.Lowered`` of the train step on the abstract inputs (no device work)."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            return self.train_step.lower(self.abstract_state, self.abstract_teacher, self.abstract_batch,
                                         self.abstract_rng)

    def global_batch(self, local: dict) -> dict:
        """This process's rows -> the step's global batch (only the keys it reads)."""
        return parallel.global_batch({k: local[k] for k in self.batch_keys}, self.mesh)

    # --- start-up (device work: real devices only)

    def hf_params(self) -> dict | None:
        """The BERT params (numpy) of ``init.hf_path`` for this program's model, or None."""
        return hf_params_for(self.config, self.model)

    def create_state(self, init_params=None) -> TrainState:
        """The sharded ``TrainState``: from the seed, or from ``init_params`` (a host tree of the
        whole student's params, e.g. another run's)."""
        c = self.config
        state, _ = create_state(self.model, self.tx, self.mesh, self.rules, c.seed, c.max_len, init_params)
        return state

    def create_state_from_bert(self, bert_params) -> TrainState:
        """The sharded ``TrainState`` whose BERT starts from ``bert_params`` (host numpy, e.g.
        ``hf_params()``); the rest of the student (COCO-LM's generator and heads) from the seed."""
        c = self.config
        state, _ = create_state(self.model, self.tx, self.mesh, self.rules, c.seed, c.max_len, bert_params,
                                at=objective_lib.bert_at(self.objective, self.model))
        return state

    def create_teacher(self, init_params=None):
        """The frozen teacher (sharded), or None without one: the objective's own teacher params
        when it has them (TaCL's ``tacl.teacher_hf_path``), else the student's initial encoder, from
        ``init_params`` (host numpy: ``hf_params()`` or another run's params) or, without them, the
        seed's initialisation (a pure function of the seed, so a resumed run rebuilds it)."""
        if self.teacher_model is None:
            return None
        if not self.teacher_from_student:
            own = self.objective.teacher_params(self.config, self.teacher_model)
            teacher, _ = create_teacher(parallel.place(own, self.teacher_shardings), self.teacher_shardings,
                                        self.teacher_dtype, self.model.config.dtype)
            return teacher
        c = self.config
        init = initial_params(self.model, self.mesh, self.rules, c.seed, c.max_len, self.state_shardings.params,
                              init_params)
        teacher, _ = create_teacher(init, self.state_shardings.params, self.teacher_dtype, self.model.config.dtype)
        return teacher

    @property
    def teacher_from_student(self) -> bool:
        """Whether the teacher is built from the student's initial params (``create_teacher``'s
        ``init_params``); False without a teacher or with one of its own."""
        return self.teacher_model is not None and not self.objective.has_own_teacher(self.config)

    # --- what is exported

    @property
    def export_model(self):
        """The Hugging Face BERT inside the student (the objective's ``bert_at``)."""
        return objective_lib.bert_of(self.objective, self.model)

    def export_params(self, params):
        """That BERT's params inside the student's ``params``."""
        return objective_lib.bert_params_of(self.objective, self.model, params)


def _batch_spec(config, step_cfg) -> dict[str, tuple[tuple[int, ...], Any]]:
    b, length = config.global_batch_size, config.max_len
    spec = {k: ((b, length), jnp.int32) for k in ("input_ids", "attention_mask", "token_type_ids")}
    if getattr(step_cfg, "whole_word", False):
        spec["word_starts"] = ((b, length), jnp.int32)
    if getattr(step_cfg, "nsp", False):
        spec["next_sentence_label"] = ((b,), jnp.int32)
    return spec


def build_program(config, devices: Sequence[Any] | None = None, *, architecture: BertConfig | None = None,
                  special_ids: dict[str, int] | None = None) -> Program:
    """The train step of ``config`` on ``devices`` (default: this run's real devices).

    ``architecture`` replaces reading ``init.hf_path``'s config.json and ``special_ids`` the
    tokenizer (``tacl_jax.aot`` compiles presets whose checkpoint is not on this machine).
    Checks the batch arithmetic against the devices' hosts. No device work: safe for
    compile-only devices.
    """
    devices = list(devices) if devices is not None else run_devices(config)
    target = Target.of(devices)
    objective = objective_lib.get(config.objective)
    rules = parallel.rules_from_config(config.logical_axis_rules)
    mesh = parallel.make_mesh(dict(config.mesh), devices)
    check_batch_arithmetic(config, mesh)
    model = model_from_config(config, target.platform, architecture)
    check_model(config, model)
    if special_ids is None:
        special_ids = tokens.run_special_ids(config.init.tokenizer_path or config.init.hf_path,
                                             model.config.vocab_size)
    step_cfg = objective.step_config(config, special_ids)
    tx, schedule = make_optimizer(config.optim, config.num_train_steps)
    abstract_state, state_sh = state_shardings(model, tx, mesh, rules, config.max_len)
    repl = parallel.replicated(mesh)

    teacher_model = objective.teacher_model(model, step_cfg)
    teacher_dtype = config.tacl.teacher_param_dtype
    teacher_sh = abstract_teacher = None
    if teacher_model is not None:
        # The teacher module's own params under the same rules: the student's encoder shardings when
        # it is the student's architecture, a larger teacher sharded the same way otherwise.
        abstract_teacher_params, teacher_sh = param_shardings(teacher_model, mesh, rules, config.max_len)
        shapes = jax.eval_shape(_teacher_cast(teacher_dtype, model.config.dtype), abstract_teacher_params)
        abstract_teacher = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                        shapes, teacher_sh)
    train_step = objective.train_step(model, step_cfg, tx, schedule, teacher_model)
    eval_step = objective.eval_step(model, step_cfg, teacher_model)
    flops = objective.flops(model, step_cfg, batch=config.global_batch_size, length=config.max_len)

    spec = _batch_spec(config, step_cfg)
    batch_sh = {k: parallel.batch_sharding(mesh, len(shape)) for k, (shape, _) in spec.items()}
    abstract_batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=batch_sh[k]) for k, (shape, dt) in spec.items()}
    abstract_rng = abstract_key(repl)
    jitted = jax.jit(train_step, in_shardings=(state_sh, teacher_sh, batch_sh, repl),
                     out_shardings=(state_sh, repl), donate_argnums=(0,))
    override = float(config.metrics.peak_flops_per_device)
    peak = override if override > 0 else peak_flops_of_kind(target.device_kind)
    return Program(config=config, objective=objective, target=target, mesh=mesh, rules=rules, model=model,
                   teacher_model=teacher_model, step_cfg=step_cfg, tx=tx, schedule=schedule, special_ids=special_ids,
                   state_shardings=state_sh, teacher_shardings=teacher_sh, batch_shardings=batch_sh,
                   abstract_state=abstract_state, abstract_teacher=abstract_teacher, abstract_batch=abstract_batch,
                   abstract_rng=abstract_rng, train_step=jitted, eval_step=jax.jit(eval_step),
                   eval_ratios=objective.ratios, flops_per_step=flops, peak_flops_per_device=peak,
                   teacher_dtype=teacher_dtype)


__all__ = ["Target", "Program", "build_program", "run_devices", "bert_config", "model_from_config", "hf_params_for",
           "build_model", "strip_heads", "check_batch_arithmetic", "check_model", "host_rows",
           "param_shardings", "state_shardings", "create_state", "create_teacher", "initial_params"]
