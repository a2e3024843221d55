"""Every fine-tuning key with its default (``configs/finetune*.py`` override them; any key also as
``--config.x.y=v``). Defaults are ``transformers``' Trainer/run_glue.py ones where they exist:
AdamW lr 2e-5, β (0.9, 0.999), ε 1e-8, weight decay 0, gradient clipping at 1.0, linear decay to 0
with no warm-up, batch 32, max length 128, 3 epochs."""

from __future__ import annotations

import ml_collections

from tacl_jax.errors import ConfigError


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # A GLUE task (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli; columns, labels and metrics
    # from tacl_jax.finetune.tasks.GLUE) or 'classification' | 'regression' | 'qa' (SQuAD v1.1 style).
    c.task = "sst2"
    c.seed = 42
    c.max_len = 128                      # ids per row incl. [CLS]/[SEP] (run_glue's max_seq_length)
    c.global_batch_size = 32             # rows per optimizer step, over all hosts
    c.eval_batch_size = 64
    c.num_train_epochs = 3.0
    c.num_train_steps = 0                # > 0: this many steps instead of num_train_epochs
    c.log_every = 50
    c.steps_per_run = 0                  # stop (with a checkpoint) after this many steps; 0 = run to the end
    c.eval_every = 0                     # evaluate on the validation split every N steps (0 = at the end only)
    c.results_file = "results.json"      # in the workdir: the final metrics, as run_glue's all_results.json
    # Write workdir/export/final at the end: a folder transformers loads as
    # {Bert,Roberta,Electra}ForSequenceClassification / ...ForQuestionAnswering (finetune.export).
    c.export_at_end = True

    c.init = ml_collections.ConfigDict()
    # A Hugging Face BERT folder or Hub id (hf.resolve: the cache only when offline), or a
    # tacl_jax pre-training workdir (its export/final, else its latest checkpoint exported).
    c.init.path = ""
    c.init.tokenizer_path = ""           # '' = init.path's tokenizer (a workdir: its run's tokenizer)

    c.model = ml_collections.ConfigDict()
    c.model.dtype = "float32"            # compute dtype; 'auto' = bfloat16 on TPU/GPU (tacl_jax.precision)
    c.model.param_dtype = "float32"
    c.model.hidden_dropout_prob = -1.0   # < 0: the checkpoint's config.json value
    c.model.attention_probs_dropout_prob = -1.0
    c.model.classifier_dropout = -1.0    # < 0: hidden_dropout_prob (transformers' rule)
    c.model.dropout_bits = 16

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 2e-5
    c.optim.warmup_steps = 0             # -1: use warmup_fraction (Trainer's warmup_ratio)
    c.optim.warmup_fraction = 0.0
    c.optim.weight_decay = 0.0           # never on biases and LayerNorm (Trainer's rule)
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.clip_norm = 1.0              # Trainer's max_grad_norm; 0 = off
    c.optim.fused = True

    c.data = ml_collections.ConfigDict()
    c.data.train_file = ""               # .csv | .tsv | .jsonl
    c.data.validation_file = ""
    c.data.validation_mismatched_file = ""   # mnli: the mismatched validation split (reported with '_mm')
    c.data.hf_dataset = ""               # e.g. 'glue' (or 'squad'): read from the datasets cache when no files
    c.data.hf_config = ""                # e.g. 'sst2'; '' = the GLUE task's name for 'glue'
    c.data.train_split = "train"
    c.data.validation_split = ""         # '' = the task's (GLUE: validation / validation_matched)
    c.data.text_column = ""              # '' = the task's (GLUE table; 'sentence' for generic tasks)
    c.data.text_pair_column = ""         # '' = single sentences (generic) / the GLUE table's
    c.data.label_column = ""             # '' = 'label'
    c.data.label_list = ()               # generic classification: class names in index order (() = sorted train values)
    c.data.metrics = ()                  # generic tasks: metric names (() = accuracy[, f1] / pearson, spearmanr)
    c.data.question_column = "question"  # qa
    c.data.context_column = "context"
    c.data.answers_column = "answers"    # {'text': [...], 'answer_start': [...]} as the 'squad' dataset
    c.data.max_train_samples = 0         # 0 = all
    c.data.max_eval_samples = 0

    c.qa = ml_collections.ConfigDict()
    c.qa.doc_stride = 128                # overlap of consecutive windows, in tokens (run_qa's)
    c.qa.max_answer_length = 30
    c.qa.n_best_size = 20

    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.mesh_devices = 0
    c.logical_axis_rules = ()            # empty = tacl_jax.parallel.LOGICAL_AXIS_RULES

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 0               # save every N steps (0 = only at the end)
    c.checkpoint.keep = 1
    c.checkpoint.keep_every = 0
    c.checkpoint.async_save = False
    return c


_POSITIVE = ("max_len", "global_batch_size", "eval_batch_size", "log_every", "qa.max_answer_length",
             "qa.n_best_size", "optim.learning_rate")
_NON_NEGATIVE = ("num_train_epochs", "num_train_steps", "steps_per_run", "eval_every", "optim.weight_decay",
                 "optim.clip_norm", "checkpoint.every", "data.max_train_samples", "data.max_eval_samples",
                 "qa.doc_stride")


def validate(c: ml_collections.ConfigDict) -> None:
    """A value that cannot run -> ``ConfigError`` naming the key and what to use."""
    def get(path):
        node = c
        for part in path.split("."):
            node = node[part]
        return node
    for path in _POSITIVE:
        if not get(path) > 0:
            raise ConfigError(f"config.{path}={get(path)!r}: use a value > 0")
    for path in _NON_NEGATIVE:
        if get(path) < 0:
            raise ConfigError(f"config.{path}={get(path)!r}: use a value >= 0")
    if c.num_train_steps == 0 and c.num_train_epochs == 0:
        raise ConfigError("config.num_train_epochs and num_train_steps are both 0: set one of them")
    if c.task == "qa" and c.qa.doc_stride >= c.max_len - 3:
        raise ConfigError(f"config.qa.doc_stride={c.qa.doc_stride} leaves no room in max_len {c.max_len}: "
                          "use a stride well below max_len (run_qa's 128 for 384)")
