"""Every configuration key, with its default, in one place; ``configs/*.py`` override them.

``validate(config)`` runs at start-up and turns a value out of range (``CHECKS``, one entry per
key) or a bad combination into a clear error before anything is compiled. Unknown keys are refused
by ``ml_collections`` itself (configs are locked); ``unknown_key`` words that refusal for the
command line. ``resume_changes`` compares a checkpoint's saved config with this run's, and
``ConfigChangedError`` refuses the changes a resumed run cannot make.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from tacl_jax import precision
from tacl_jax.errors import ConfigError
from tacl_jax.data import config as data_config
from tacl_jax.models import REMAT_POLICIES
from tacl_jax.models.coco_lm import SAMPLE_MODES
from tacl_jax.models.dropout import DROPOUT_BITS
from tacl_jax.objectives.coco_lm import CLM_FORMS, coco_lm_config
from tacl_jax.objectives.masking import BUDGETS as MASKING_BUDGETS
from tacl_jax.parallel import DISTRIBUTED_MODES

OBJECTIVES = ("tacl", "mlm", "coco_lm")
TEACHER_PARAM_DTYPES = ("compute", "float32", "bfloat16")


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.objective = "tacl"                 # 'tacl' (MLM + token contrastive) | 'mlm' (baseline) | 'coco_lm'
    c.seed = 0
    c.max_len = 256
    c.global_batch_size = 256            # sequences per optimizer step, over all hosts
    c.grad_accum_steps = 1               # micro-batches per step (lax.scan), weighted by token count
    c.num_train_steps = 150_000
    c.steps_per_run = 0                  # stop (with a checkpoint) after this many steps; 0 = run to the end
    c.log_every = 50
    c.eval_every = 0                     # held-out MLM/TaCL metrics every N steps (0 = off)
    c.eval_at_end = True
    c.eval_batches = 4                   # global batches of the held-out split per evaluation
    c.hf_export_every = 0                # a Hugging Face export every N steps (0 = off)
    c.export_at_end = True               # workdir/export/final: a BertForMaskedLM folder
    c.demo_fill_mask = ""                # after training: run this sentence through the export
    c.nsp = False                        # BERT's next-sentence objective (needs sentence-pair data)
    # 'START,STOP' (e.g. '5,8'): a jax.profiler trace of the training steps that take the state from
    # step START to step STOP (STOP-START steps: metrics.jsonl steps START+1..STOP; START >= 1 keeps
    # compilation out), process 0 only, into workdir/profile/: *.xplane.pb for TensorBoard's Profile
    # tab (xprof) and perfetto_trace.json.gz for ui.perfetto.dev. '' = off. See README "Profiling".
    c.profile_steps = ""

    c.init = ml_collections.ConfigDict()
    c.init.hf_path = ""                  # Hugging Face BERT folder: student and teacher start here
    #                                      (RoBERTa and ELECTRA too; tacl_jax.hf)
    c.init.tokenizer_path = ""           # default: init.hf_path
    c.init.from_scratch = False          # required to train TaCL without hf_path (random teacher)
    c.init.params_from = ""              # another run's workdir: start from its latest params
    # The step of init.params_from to start from (-1 = its latest). A fresh run records the step it
    # used here, so a resumed TaCL run rebuilds its teacher from the same params.
    c.init.params_from_step = -1
    # Architecture used only when there is no hf_path (from scratch, tests, benchmarks).
    c.init.scratch = ml_collections.ConfigDict(dict(
        vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2))

    c.model = ml_collections.ConfigDict()
    # compute dtype: 'auto' (bf16 on TPU/GPU and CPUs with bf16 units, else f32; tacl_jax.precision)
    # | 'bfloat16' | 'float32'
    c.model.dtype = "auto"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "none"        # 'none' | 'full' | 'save_dots' (saves memory with scan_layers=True)
    c.model.scan_layers = False          # one nn.scan over the layers: params encoder/layers/... [N, ...]
    c.model.hidden_dropout_prob = 0.1
    c.model.attention_probs_dropout_prob = 0.1
    # 16: dropout masks from 16-bit uniforms, four per threefry block (a quarter of the PRNG work; rate
    # quantised to 1/65536; tacl_jax.models.dropout); 32: flax's nn.Dropout, one block per element.
    c.model.dropout_bits = 16
    c.model.vocab_multiple = 128
    # TaCL/MLM steps: the student's last layer only at the predicted positions (~15%), the only ones
    # MLM and TaCL read (keys/values still from every position; same loss; 12.4% fewer FLOPs at the
    # bench's 'small', 4.6% at bert-base). With scan_layers the scan covers the first N-1 layers and
    # the last runs on its own (tacl_jax.models.bert). NSP adds [CLS] as one more slot.
    c.model.gather_last_layer = True

    c.masking = ml_collections.ConfigDict()
    c.masking.mask_prob = 0.15
    c.masking.replace_prob = 0.8         # of the selected: → [MASK]
    c.masking.random_prob = 0.1          # of the selected: → random token (rest unchanged)
    # slots per sequence; 0 = round(mask_prob · max_len) (budget 'tacl' with whole words: at least max_len // 4;
    # 'bernoulli': enough that a full row overflows them with probability ≤ 1e-6)
    c.masking.max_predictions = 0
    c.masking.whole_word = False
    # How many positions a row selects (tacl_jax.objectives.masking): 'bert' = max(1, round(mask_prob · n))
    # sub-tokens, n the row's real tokens (whole words fill that budget: BERT's rule); 'tacl' = the TaCL
    # authors' code: the same capped at max_len // 4 for sub-words, min(w // 4, max(1, round(mask_prob · w)))
    # whole words of the row's w words with whole_word (every sub-token of them); 'bernoulli' = each
    # sub-token independently with probability mask_prob (Hugging Face's collator; sub-words only).
    c.masking.budget = "bert"

    c.tacl = ml_collections.ConfigDict()
    c.tacl.temperature = 0.01
    c.tacl.mask_pad_keys = True          # False = keep [PAD] keys in the softmax (the original)
    c.tacl.teacher_dropout = False       # True = dropout in the teacher (the original's bug)
    # Anchors of the contrastive loss: 'selected' = the masked positions (the paper and the authors'
    # code); 'all' = every non-pad position (a control of bench/tacl_effect.py; needs the full last
    # layer, so model.gather_last_layer is ignored).
    c.tacl.anchors = "selected"
    # 'compute': the frozen teacher's matmul kernels stored in the compute dtype (no per-step cast,
    # outputs bit-identical to 'float32'); 'float32'; 'bfloat16' (every leaf, embeddings too).
    c.tacl.teacher_param_dtype = "compute"
    # '' = the teacher is the student's initial encoder (the paper). A Hugging Face BERT folder or Hub
    # id = a teacher of its own, of any size with the student's tokenizer (bert-large-uncased
    # teaching bert-base-uncased): the student learns a linear map into its hidden size
    # (tacl_jax.train.teacher, tacl_jax.models.tacl_student), checkpointed, never exported.
    c.tacl.teacher_hf_path = ""

    c.loss_weights = ml_collections.ConfigDict(dict(mlm=1.0, tacl=1.0, nsp=1.0))
    c.coco_lm = coco_lm_config()         # used when objective == 'coco_lm'

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-4
    c.optim.warmup_steps = -1            # -1: use warmup_fraction
    c.optim.warmup_fraction = 0.1
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.clip_norm = 1.0              # 0 = no clipping
    c.optim.fused = True                 # optax clip+adamw without the clipped-gradient copy (train/optimizer.py)

    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.mesh_devices = 0                   # use only the first N devices (0 = all)
    c.logical_axis_rules = ()            # empty = tacl_jax.parallel.LOGICAL_AXIS_RULES

    c.distributed = ml_collections.ConfigDict()
    c.distributed.initialize = "auto"    # 'auto' | 'always' | 'never'
    c.distributed.coordinator_address = ""
    c.distributed.num_processes = 1
    c.distributed.process_id = 0
    c.distributed.local_device_ids = ()

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 1000            # save every N steps (also at the end and on SIGTERM)
    c.checkpoint.keep = 3                # the N most recent are kept ...
    c.checkpoint.keep_every = 0          # ... plus every K-th step permanently (0 = none)
    c.checkpoint.async_save = True

    c.metrics = ml_collections.ConfigDict()
    c.metrics.peak_flops_per_device = 0.0  # for MFU; 0 = tacl_jax.flops.PEAK_FLOPS by device kind

    # After training (process 0, after the final export): layer-wise self-similarity of the export
    # (and of init.hf_path) on held-out sentences -> workdir/analysis/ (see tacl_jax.analyze).
    c.analysis = ml_collections.ConfigDict()
    c.analysis.enabled = True            # skipped, with a log line, when the run has no held-out text
    c.analysis.num_sentences = 200       # held-out sentences drawn (seed: config.seed)
    c.analysis.compare_init = True       # also analyse init.hf_path (when set): one chart, two lines
    c.analysis.max_len = 128             # ids per sentence incl. [CLS]/[SEP] (≤ max_position_embeddings)
    c.analysis.batch_size = 32           # sentences per forward pass

    c.data = data_config.default_config()
    return c


def load_config_file(path: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
    """``get_config()`` of a config file given by path (how presets build on ``configs/base.py``
    and tests on ``configs/tiny.py``, without making ``configs/`` a package), with ``overrides``
    (``{"optim.learning_rate": 1e-4}``, as ``--config.optim.learning_rate=1e-4``) applied."""
    import importlib.util
    import os

    name = "tacl_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return override(module.get_config(), overrides or {})


def override(c: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """``c`` with each dotted key of ``overrides`` set (in place; returned for chaining); a key
    ``c`` does not have is refused with ``unknown_key``'s message."""
    for path, value in overrides.items():
        error = unknown_key(c, path)
        if error:
            raise ConfigError(error)
        *parents, leaf = path.split(".")
        node = c
        for part in parents:
            node = node[part]
        node[leaf] = value
    return c


def parse_profile_steps(value: str, num_train_steps: int | None = None) -> tuple[int, int] | None:
    """``config.profile_steps`` -> ``(START, STOP)``, or None when empty (off). A clear ValueError
    for anything but two integers 0 <= START < STOP (<= num_train_steps when given)."""
    text = "" if value is None else str(value).strip()
    if not text:
        return None
    bound = f" <= num_train_steps ({num_train_steps})" if num_train_steps is not None else ""
    usage = (f"; use 'START,STOP' with integers 0 <= START < STOP{bound}, e.g. --config.profile_steps=5,8 "
             "traces the steps that take the state from step 5 to step 8 (3 steps); '' turns profiling off")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(re.fullmatch(r"[+-]?[0-9]+", p) for p in parts):
        raise ConfigError(f"config.profile_steps={value!r} is not two integers 'START,STOP'" + usage)
    start, stop = int(parts[0]), int(parts[1])
    if start < 0:
        raise ConfigError(f"config.profile_steps={value!r}: START {start} is negative" + usage)
    if stop <= start:
        raise ConfigError(f"config.profile_steps={value!r}: STOP {stop} must be greater than START {start}" + usage)
    if num_train_steps is not None and stop > num_train_steps:
        raise ConfigError(f"config.profile_steps={value!r}: STOP {stop} is past the run's last step "
                         f"(num_train_steps {num_train_steps})" + usage)
    return start, stop


# ----------------------------------------------------------------------------- value checks

@dataclasses.dataclass(frozen=True)
class Range:
    """The allowed values of a numeric key: the interval from ``lo`` to ``hi`` (closed unless
    ``lo_open`` / ``hi_open``; None = unbounded; a key path such as ``'max_len'`` = that key's
    value), plus the sentinels in ``also`` (e.g. -1 = 'derive it'). With ``when`` (a bool key) the
    range applies only while that key is True. Non-finite values (nan, inf) are always refused."""

    lo: Any = None
    hi: Any = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple = ()
    when: str | None = None

    def error(self, path: str, value, c) -> str | None:
        if self.when and not _get(c, self.when):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"config.{path}={value!r} is not a number: must be {self.describe(c)}"
        if value in self.also:
            return None
        if not math.isfinite(value):
            return f"config.{path}={value!r} is out of range: must be finite and {self.describe(c)}"
        lo, hi = _bound(self.lo, c), _bound(self.hi, c)
        ok = ((lo is None or (value > lo if self.lo_open else value >= lo))
              and (hi is None or (value < hi if self.hi_open else value <= hi)))
        return None if ok else f"config.{path}={value!r} is out of range: must be {self.describe(c)}"

    def describe(self, c=None) -> str:
        lo, hi = _bound_text(self.lo, c), _bound_text(self.hi, c)
        if lo is not None and hi is not None:
            text = f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        elif lo is not None:
            text = f"{'>' if self.lo_open else '>='} {lo}"
        elif hi is not None:
            text = f"{'<' if self.hi_open else '<='} {hi}"
        else:
            text = "a finite number"
        text += "".join(f" or {a}" for a in self.also)
        return text + (f" (when {self.when})" if self.when else "")


@dataclasses.dataclass(frozen=True)
class OneOf:
    """The allowed values of a key that picks one of a few settings."""

    choices: tuple

    def error(self, path: str, value, c) -> str | None:
        return None if value in self.choices else f"config.{path}={value!r}: use one of {self.choices}"

    def describe(self, c=None) -> str:
        return f"one of {self.choices}"


def _get(c, path: str):
    for part in path.split("."):
        c = c[part]
    return c


def _bound(bound, c):
    return _get(c, bound) if isinstance(bound, str) else bound


def _bound_text(bound, c) -> str | None:
    if isinstance(bound, str):
        return bound if c is None else f"{bound}={_get(c, bound)}"
    return None if bound is None else repr(bound)


POSITIVE_INT = Range(lo=1)
COUNT = Range(lo=0)                       # 0 = off / none / derive it
POSITIVE = Range(lo=0, lo_open=True)
NONNEG = Range(lo=0)
PROB = Range(lo=0, hi=1)                  # a probability or a share
RATE = Range(lo=0, hi=1, hi_open=True)    # dropout, Adam's betas: 1 would never forget / drop all

# Every numeric key of default_config(), and the keys that pick one of a few settings, once: the
# allowed values. tests/test_config.py fails on a numeric key that is not here or in
# DELEGATED_CHECKS, so a new key cannot be forgotten. Bounds that depend on another key name it.
CHECKS: dict[str, Range | OneOf] = {
    "objective": OneOf(OBJECTIVES),
    "seed": Range(lo=0),                  # numpy's default_rng refuses negative seeds
    "max_len": Range(lo=5),               # [CLS] a [SEP] b [SEP]: room for one token per side
    "global_batch_size": POSITIVE_INT,
    "grad_accum_steps": POSITIVE_INT,
    "num_train_steps": POSITIVE_INT,
    "steps_per_run": COUNT,
    "log_every": POSITIVE_INT,
    "eval_every": COUNT,
    "eval_batches": POSITIVE_INT,
    "hf_export_every": COUNT,
    # Toy vocabularies put the special ids at 0..4 (tokens.default_special_ids): one regular id more.
    "init.scratch.vocab_size": Range(lo=6),
    "init.params_from_step": Range(lo=-1),
    "init.scratch.hidden_size": POSITIVE_INT,
    "init.scratch.num_hidden_layers": POSITIVE_INT,
    "init.scratch.num_attention_heads": POSITIVE_INT,
    "init.scratch.intermediate_size": POSITIVE_INT,
    "init.scratch.max_position_embeddings": POSITIVE_INT,
    "init.scratch.type_vocab_size": POSITIVE_INT,
    "model.dtype": OneOf(precision.CHOICES),
    "model.remat_policy": OneOf(REMAT_POLICIES),
    "model.hidden_dropout_prob": RATE,
    "model.attention_probs_dropout_prob": RATE,
    "model.dropout_bits": OneOf(DROPOUT_BITS),
    "model.vocab_multiple": POSITIVE_INT,
    "masking.mask_prob": Range(lo=0, hi=1, lo_open=True, hi_open=True),
    "masking.replace_prob": PROB,
    "masking.random_prob": PROB,
    # Slots per row (0 = round(mask_prob · max_len)); more slots than positions cannot be filled.
    "masking.max_predictions": Range(lo=0, hi="max_len"),
    "masking.budget": OneOf(MASKING_BUDGETS),
    "tacl.temperature": POSITIVE,
    "tacl.teacher_param_dtype": OneOf(TEACHER_PARAM_DTYPES),
    "tacl.anchors": OneOf(("selected", "all")),
    "loss_weights.mlm": NONNEG,
    "loss_weights.tacl": NONNEG,
    "loss_weights.nsp": NONNEG,
    "coco_lm.generator_layers": POSITIVE_INT,
    "coco_lm.generator_sample_mode": OneOf(SAMPLE_MODES),
    "coco_lm.crop_fraction": Range(lo=0, hi=1, lo_open=True),
    "coco_lm.scl_dim": COUNT,             # 0 = the hidden size
    "coco_lm.temperature": POSITIVE,
    # SCL negatives within groups of this many sequences (0 = the whole micro-batch). Its fit to the
    # batch, (global_batch_size / grad_accum_steps) % it == 0, is checked by the COCO-LM step only
    # (coco_step.check_scl_groups): the default 16 must not refuse small TaCL/MLM batches.
    "coco_lm.scl_group_size": COUNT,
    "coco_lm.clm_form": OneOf(CLM_FORMS),
    "coco_lm.loss_weights.gen_mlm": NONNEG,
    "coco_lm.loss_weights.binary": NONNEG,
    "coco_lm.loss_weights.clm": NONNEG,
    "coco_lm.loss_weights.scl": NONNEG,
    "optim.learning_rate": NONNEG,
    "optim.warmup_steps": Range(lo=0, also=(-1,)),   # -1: use warmup_fraction
    "optim.warmup_fraction": PROB,
    "optim.weight_decay": NONNEG,
    "optim.b1": RATE,
    "optim.b2": RATE,
    # Adam divides by sqrt(v) + eps, and v is exactly 0 for embedding rows no batch has touched.
    "optim.eps": POSITIVE,
    "optim.clip_norm": NONNEG,            # 0 = no clipping
    "mesh.data": Range(lo=1, also=(-1,)),  # -1: the devices left over (at most one axis)
    "mesh.fsdp": Range(lo=1, also=(-1,)),
    "mesh.tensor": Range(lo=1, also=(-1,)),
    "mesh_devices": COUNT,                # 0 = all
    "distributed.initialize": OneOf(DISTRIBUTED_MODES),
    "distributed.num_processes": POSITIVE_INT,
    "distributed.process_id": Range(lo=0, hi="distributed.num_processes", hi_open=True),
    "checkpoint.every": COUNT,            # 0 = only at the end and on SIGTERM
    "checkpoint.keep": POSITIVE_INT,      # Orbax keeps at least the newest one anyway
    "checkpoint.keep_every": COUNT,
    "metrics.peak_flops_per_device": NONNEG,   # 0 = by device kind
    "analysis.num_sentences": Range(lo=1, when="analysis.enabled"),
    "analysis.max_len": Range(lo=3, when="analysis.enabled"),   # [CLS] w [SEP]
    "analysis.batch_size": Range(lo=1, when="analysis.enabled"),
    "data.shuffle_seed_offset": Range(lo=0),
    "data.first_regular_id": Range(lo=0, also=(-1,)),   # -1: 999 or 5 by vocabulary size
}

# Numeric keys whose range tacl_jax.data.config.validate checks (it also guards `prepare`, which
# has no run config); validate() calls it.
DELEGATED_CHECKS = {"data.short_seq_prob", "data.eval_fraction", "data.num_shards", "data.worker_count",
                    "data.read_threads", "data.prefetch"}


def validate(c: ml_collections.ConfigDict) -> None:
    """Checks that need no devices: every key of ``CHECKS``, then the combinations. A ValueError
    names the key, its value and what is allowed. Device-dependent checks live in
    ``tacl_jax.train.loop``."""
    for path, check in CHECKS.items():
        error = check.error(path, _get(c, path), c)
        if error:
            raise ConfigError(error)
    if not isinstance(c.model.scan_layers, bool):
        raise ConfigError(f"config.model.scan_layers={c.model.scan_layers!r}: use True or False")
    data_config.validate(c.data)
    if c.nsp and c.data.packing != "nsp_pairs" and c.data.source != "synthetic":
        raise ConfigError("config.nsp=True needs sentence pairs: set config.data.packing='nsp_pairs'")
    if c.tacl.teacher_hf_path and c.objective != "tacl":
        raise ConfigError(f"config.tacl.teacher_hf_path is set but objective is {c.objective!r}, which has no "
                         "TaCL teacher: unset it, or use objective 'tacl'")
    if c.objective == "tacl" and not (c.init.hf_path or c.init.params_from or c.tacl.teacher_hf_path) \
            and not c.init.from_scratch:
        raise ConfigError("TaCL needs a pretrained teacher: set config.init.hf_path to a Hugging Face BERT "
                         "folder, or config.init.from_scratch=True to train against a random teacher "
                         "(meaningful only for tests and benchmarks)")
    parse_profile_steps(c.get("profile_steps", ""), c.num_train_steps)
    if c.global_batch_size % c.grad_accum_steps:
        raise ConfigError(f"global_batch_size {c.global_batch_size} is not divisible by "
                         f"grad_accum_steps {c.grad_accum_steps}")
    if c.masking.replace_prob + c.masking.random_prob > 1:
        raise ConfigError(f"config.masking: replace_prob + random_prob = {c.masking.replace_prob} + "
                         f"{c.masking.random_prob} > 1 (they split the selected tokens; the rest stay)")
    if c.masking.budget == "bernoulli" and c.masking.whole_word:
        raise ConfigError("config.masking.budget='bernoulli' draws sub-tokens one by one and cannot mask whole "
                          "words: set masking.whole_word=False, or budget 'bert' or 'tacl'")
    if c.objective == "coco_lm" and c.masking.budget != "bert":
        raise ConfigError(f"config.masking.budget={c.masking.budget!r} is not wired into the COCO-LM step "
                         "(tacl_jax.train.coco_step), which masks with 'bert': use it with objective 'tacl' or 'mlm'")
    if sum(1 for a in ("data", "fsdp", "tensor") if c.mesh[a] == -1) > 1:
        raise ConfigError(f"config.mesh={dict(c.mesh)}: at most one axis may be -1")


# ----------------------------------------------------------------------------- unknown keys

def _is_group(node) -> bool:
    return isinstance(node, (ml_collections.ConfigDict, Mapping))


def _leaf_paths(node, prefix: str = "") -> list[str]:
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out += _leaf_paths(value, path + ".") if _is_group(value) else [path]
    return out


def _nearest(name: str, candidates) -> list[str]:
    """Keys ``name`` was probably meant to be: spelling (difflib), initials ('lr' ->
    'learning_rate', which difflib scores low) and prefixes ('warmup' -> 'warmup_steps')."""
    candidates = list(candidates)
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    initials = [k for k in candidates if len(name) > 1 and "".join(w[:1] for w in k.split("_")) == name]
    prefixed = [k for k in candidates if len(name) > 2 and k.startswith(name)]
    return list(dict.fromkeys(close + initials + prefixed))[:3]


def unknown_key(config: ml_collections.ConfigDict, path: str) -> str | None:
    """None when ``path`` (``optim.learning_rate``) names a key of ``config``; else a one-line error
    naming it, the nearest keys and the keys of its group, e.g. ``unknown config key optim.lr; did
    you mean optim.learning_rate? (keys of optim: ...)``. Paths that index a sequence
    (``a[0]``) are left to ml_collections."""
    node, seen = config, []
    for part in path.split("."):
        if "[" in part:
            return None
        where = ".".join(seen)
        if not _is_group(node):
            return (f"unknown config key {path}: config.{where} is a value ({node!r}), not a group of keys; "
                    f"override it with --config.{where}=...")
        if part not in node:
            near = [f"{where}.{k}" if where else k for k in _nearest(part, node.keys())]
            # The same name elsewhere: --config.learning_rate -> optim.learning_rate.
            near += [p for p in _leaf_paths(config) if p.rsplit(".", 1)[-1] == part]
            near = list(dict.fromkeys(near))[:4]
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            return f"unknown config key {path}{hint} (keys of {where or 'config'}: {', '.join(node.keys())})"
        node = node[part]
        seen.append(part)
    return None


# ----------------------------------------------------------------------------- resuming

REFUSE, WARN, IGNORE = "refuse", "warn", "ignore"
# init.hf_path: a path may name the same model moved elsewhere (another VM, another mount), so only
# set <-> unset (a pretrained <-> a random teacher) is refused; another path is warned.
PATH = "path"

# How a resumed run treats a change of each key, by key path or group prefix: the longest
# matching prefix decides. tests/test_config.py checks that every key of default_config() is
# matched. Reasons in resume_changes' docstring.
RESUME_RULES: dict[str, str] = {
    "objective": REFUSE,
    "seed": REFUSE,
    "nsp": REFUSE,
    "masking": REFUSE,
    "tacl": REFUSE,
    "tacl.teacher_param_dtype": WARN,
    "tacl.teacher_hf_path": PATH,
    "loss_weights": REFUSE,
    "coco_lm": REFUSE,
    "model": REFUSE,
    "model.dtype": WARN,
    "model.remat_policy": IGNORE,
    "model.gather_last_layer": IGNORE,
    "init.scratch": REFUSE,
    "init.hf_path": PATH,
    "init.tokenizer_path": WARN,
    "init.from_scratch": IGNORE,
    "init.params_from": IGNORE,
    "init.params_from_step": IGNORE,
    "optim": WARN,
    "optim.fused": IGNORE,
    "num_train_steps": WARN,
    "global_batch_size": WARN,
    "max_len": WARN,
    "data": WARN,
    "data.worker_count": IGNORE,
    "data.read_threads": IGNORE,
    "data.prefetch": IGNORE,
    "grad_accum_steps": IGNORE,
    "steps_per_run": IGNORE,
    "log_every": IGNORE,
    "eval_every": IGNORE,
    "eval_at_end": IGNORE,
    "eval_batches": IGNORE,
    "hf_export_every": IGNORE,
    "export_at_end": IGNORE,
    "demo_fill_mask": IGNORE,
    "profile_steps": IGNORE,
    "mesh": IGNORE,
    "mesh_devices": IGNORE,
    "logical_axis_rules": IGNORE,
    "distributed": IGNORE,
    "checkpoint": IGNORE,
    "metrics": IGNORE,
    "analysis": IGNORE,
}


def resume_rule(path: str) -> str | None:
    """The ``RESUME_RULES`` entry that decides ``path`` (longest prefix), or None."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        rule = RESUME_RULES.get(".".join(parts[:n]))
        if rule:
            return rule
    return None


def _flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same(a, b) -> bool:
    """Equal after a JSON round trip: tuples are lists; 1 == 1.0 and 1e-4 == 0.0001 (numbers by
    value), but True is not 1; nan equals nan."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    numbers = [isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)]
    if all(numbers):
        return float(a) == float(b) or (math.isnan(float(a)) and math.isnan(float(b)))
    if any(numbers) or isinstance(a, bool) != isinstance(b, bool):
        return False
    return a == b


def resume_changes(saved: Mapping | None, config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
    """Compare the config a checkpoint was written with (``saved``: the JSON dict of
    ``config.to_json_best_effort()``) with this run's. Returns ``(refused, warned)``, lines
    ``key: old -> new`` in config order. Pure: no logging, no I/O.

    Refused (the checkpoint's params and optimizer state belong to another training problem):
      * ``objective``, ``nsp``, ``masking.*``, ``tacl.*``, ``loss_weights.*``, ``coco_lm.*``: the loss;
      * ``model.*``: the architecture and its training-time behaviour (dropout rates and bits,
        ``param_dtype``, ``vocab_multiple``: the params' shapes and dtypes, ``scan_layers``: their
        tree, which Orbax would fail to restore with a raw error);
      * ``init.scratch.*`` (the architecture when there is no ``hf_path``; not compared when both
        configs have an ``hf_path``, whose model is then the architecture);
      * ``init.hf_path`` set <-> unset: the teacher (rebuilt from it at every start) changes between a
        pretrained and a random one;
      * ``seed``: the masks, dropout and data order, and for a run without ``hf_path`` its random
        teacher (the seed's init), which a resumed student would no longer share.
    Warned (the run goes on; one line per key):
      * ``optim.*``, ``num_train_steps``: the optimizer and the schedule (lr jumps where it resumes);
      * ``global_batch_size``, ``max_len``, ``data.*`` that change the batches (source, packing,
        shards, shuffle offset, ...): the data iterator also says so when it is restored;
      * ``init.hf_path`` / ``init.tokenizer_path`` to another path (the same model moved?), and
        ``model.dtype``, ``tacl.teacher_param_dtype``: compute and storage precision, same state.
    Neither (how the run is executed or reported, not what it learns): ``grad_accum_steps`` (the
    same weighted step), ``model.remat_policy``, ``model.gather_last_layer``, ``optim.fused`` (the
    same math), ``init.from_scratch`` (a start-up guard), ``init.params_from`` and
    ``init.params_from_step`` (the student's start is read only when the workdir has no checkpoint;
    a resumed TaCL run without ``init.hf_path`` re-reads its teacher from the saved ones),
    ``steps_per_run``, ``log_every``, ``eval_*``, ``hf_export_every``, ``export_at_end``, ``demo_fill_mask``, ``profile_steps``, ``mesh*``, ``logical_axis_rules``,
    ``distributed.*``, ``checkpoint.*``, ``metrics.*``, ``analysis.*``, ``data.worker_count`` /
    ``read_threads`` / ``prefetch``.

    Keys on one side only (a checkpoint of an older or newer version) are not compared, nor a key
    that is a group on one side and a value on the other; a key no rule matches is warned. An empty
    or None ``saved`` (a checkpoint without its config) compares nothing.
    """
    if not saved:
        return [], []
    old = _flat(saved)
    new = _flat(json.loads(config.to_json_best_effort()))
    both_pretrained = bool(old.get("init.hf_path")) and bool(new.get("init.hf_path"))
    refused, warned = [], []
    for path, b in new.items():
        if path not in old or _same(old[path], b):
            continue
        a = old[path]
        rule = resume_rule(path) or WARN
        if path.startswith("init.scratch.") and both_pretrained:
            rule = IGNORE
        line = f"{path}: {json.dumps(a)} -> {json.dumps(b)}"
        if rule == PATH:
            rule = REFUSE if bool(a) != bool(b) else WARN
            if rule == WARN:
                line += " (the same model moved? it is read from the new path)"
        if rule == REFUSE:
            refused.append(line)
        elif rule == WARN:
            warned.append(line)
    return refused, warned


class ConfigChangedError(ConfigError):
    """A resumed run's config changes what its checkpoint was trained for: ``refused`` are the
    lines of ``resume_changes``, ``workdir`` the run's workdir (what ``init.params_from`` takes).
    One message: every refused change, then the ways out."""

    def __init__(self, refused: Sequence[str], workdir: str):
        self.refused, self.workdir = list(refused), workdir
        super().__init__(
            f"{workdir} holds a checkpoint trained with another config, which a resumed run cannot "
            f"change: {'; '.join(self.refused)}. Use a new --workdir, or a new --workdir with "
            f"--config.init.params_from={workdir} to start from this run's params (optimizer state and "
            "step start afresh), or rerun with the old values")
