"""Every configuration key, with its default, in one place; ``configs/*.py`` override them.

``validate(config)`` runs at start-up and turns a bad combination into a clear error before
anything is compiled. Unknown keys are refused by ``ml_collections`` itself (configs are locked).
"""

from __future__ import annotations

import re

import ml_collections

from tacl_jax import precision
from tacl_jax.data import config as data_config
from tacl_jax.models import REMAT_POLICIES
from tacl_jax.models.dropout import DROPOUT_BITS
from tacl_jax.objectives.coco_lm import coco_lm_config

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
    c.init.tokenizer_path = ""           # default: init.hf_path
    c.init.from_scratch = False          # required to train TaCL without hf_path (random teacher)
    c.init.params_from = ""              # another run's workdir: start from its latest params
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
    c.masking.max_predictions = 0        # slots per sequence; 0 = round(mask_prob · max_len)
    c.masking.whole_word = False

    c.tacl = ml_collections.ConfigDict()
    c.tacl.temperature = 0.01
    c.tacl.mask_pad_keys = True          # False = keep [PAD] keys in the softmax (the original)
    c.tacl.teacher_dropout = False       # True = dropout in the teacher (the original's bug)
    # 'compute': the frozen teacher's matmul kernels stored in the compute dtype (no per-step cast,
    # outputs bit-identical to 'float32'); 'float32'; 'bfloat16' (every leaf, embeddings too).
    c.tacl.teacher_param_dtype = "compute"

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


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """``get_config()`` of a config file given by path (how presets build on ``configs/base.py``
    and tests on ``configs/tiny.py``, without making ``configs/`` a package)."""
    import importlib.util
    import os

    name = "tacl_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


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
        raise ValueError(f"config.profile_steps={value!r} is not two integers 'START,STOP'" + usage)
    start, stop = int(parts[0]), int(parts[1])
    if start < 0:
        raise ValueError(f"config.profile_steps={value!r}: START {start} is negative" + usage)
    if stop <= start:
        raise ValueError(f"config.profile_steps={value!r}: STOP {stop} must be greater than START {start}" + usage)
    if num_train_steps is not None and stop > num_train_steps:
        raise ValueError(f"config.profile_steps={value!r}: STOP {stop} is past the run's last step "
                         f"(num_train_steps {num_train_steps})" + usage)
    return start, stop


def validate(c: ml_collections.ConfigDict) -> None:
    """Checks that need no devices. Device-dependent checks live in ``tacl_jax.train.loop``."""
    if c.objective not in OBJECTIVES:
        raise ValueError(f"config.objective={c.objective!r}: use one of {OBJECTIVES}")
    if c.model.dtype not in precision.CHOICES:
        raise ValueError(f"config.model.dtype={c.model.dtype!r}: use one of {precision.CHOICES}")
    if c.model.remat_policy not in REMAT_POLICIES:
        raise ValueError(f"config.model.remat_policy={c.model.remat_policy!r}: use one of {REMAT_POLICIES}")
    if not isinstance(c.model.scan_layers, bool):
        raise ValueError(f"config.model.scan_layers={c.model.scan_layers!r}: use True or False")
    if c.model.get("dropout_bits", 16) not in DROPOUT_BITS:
        raise ValueError(f"config.model.dropout_bits={c.model.dropout_bits!r}: use one of {DROPOUT_BITS}")
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if not 0.0 <= c.model[name] < 1.0:
            raise ValueError(f"config.model.{name}={c.model[name]!r}: use a rate in [0, 1)")
    data_config.validate(c.data)
    if c.nsp and c.data.packing != "nsp_pairs" and c.data.source != "synthetic":
        raise ValueError("config.nsp=True needs sentence pairs: set config.data.packing='nsp_pairs'")
    if c.objective == "tacl" and not (c.init.hf_path or c.init.params_from) and not c.init.from_scratch:
        raise ValueError("TaCL needs a pretrained teacher: set config.init.hf_path to a Hugging Face BERT "
                         "folder, or config.init.from_scratch=True to train against a random teacher "
                         "(meaningful only for tests and benchmarks)")
    if c.global_batch_size <= 0 or c.num_train_steps <= 0 or c.max_len < 5:
        raise ValueError("global_batch_size and num_train_steps must be positive and max_len >= 5")
    parse_profile_steps(c.get("profile_steps", ""), c.num_train_steps)
    if c.grad_accum_steps < 1 or c.global_batch_size % c.grad_accum_steps:
        raise ValueError(f"global_batch_size {c.global_batch_size} is not divisible by "
                         f"grad_accum_steps {c.grad_accum_steps}")
    if not 0 < c.masking.mask_prob < 1 or c.masking.replace_prob + c.masking.random_prob > 1:
        raise ValueError("masking: need 0 < mask_prob < 1 and replace_prob + random_prob <= 1")
    if c.tacl.temperature <= 0:
        raise ValueError("tacl.temperature must be positive")
    if c.tacl.teacher_param_dtype not in TEACHER_PARAM_DTYPES:
        raise ValueError(f"config.tacl.teacher_param_dtype={c.tacl.teacher_param_dtype!r}: use one of "
                         f"{TEACHER_PARAM_DTYPES}")
    if c.analysis.enabled and (c.analysis.num_sentences < 1 or c.analysis.max_len < 3 or c.analysis.batch_size < 1):
        raise ValueError("analysis: need num_sentences >= 1, max_len >= 3 and batch_size >= 1 "
                         "(or analysis.enabled=False)")
