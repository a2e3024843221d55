"""The fine-tuning run: data -> sharded model with its head -> jitted AdamW steps -> evaluation ->
``results.json``. Built from the pre-training pieces: the mesh and logical rules
(``tacl_jax.parallel``), sharded state creation (``train.setup``), the optimizer
(``train.optimizer``), Orbax checkpoints with resume (``checkpoint``), ``MetricWriter``, the
workdir lock (``train.start``) and Hugging Face loading (``hf``).

Step ``s`` reads the rows ``train_batch_indices(N, B, seed, s)`` and dropout keys
``fold_in(key(seed), s)``: a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tacl_jax import checkpoint, hf, parallel, precision
from tacl_jax.errors import ConfigError, UserError
from tacl_jax.finetune import data as data_lib
from tacl_jax.finetune import export as export_lib
from tacl_jax.finetune import heads, metrics, squad, tasks
from tacl_jax.train import outputs, setup
from tacl_jax.train import optimizer as optim_lib
from tacl_jax.train.metrics import MetricWriter, NonFiniteLossError
from tacl_jax.train.state import TrainState

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- init

def is_pretraining_workdir(path: str) -> bool:
    """A tacl_jax pre-training workdir (checkpoints/ or export/, no config.json of its own)."""
    p = os.path.expanduser(path)
    return (os.path.isdir(p) and not os.path.isfile(os.path.join(p, "config.json"))
            and (os.path.isdir(os.path.join(p, "checkpoints")) or os.path.isdir(os.path.join(p, "export"))))


def resolve_init(path: str, workdir: str) -> str:
    """``init.path`` -> a Hugging Face folder or Hub id for ``hf``. A pre-training workdir gives its
    latest checkpoint exported (once) to ``workdir/init_export`` as a ``BertModel`` folder (the
    pooler included, which the classifier reads; a run without a pooler as ``BertForMaskedLM``),
    or without checkpoints its ``export/final`` (a ``BertForMaskedLM``: no pooler, so the
    classifier's pooler starts from the seed). Anything else is passed on (``hf.resolve`` reports
    what is missing)."""
    if not path:
        raise ConfigError("config.init.path is empty: give a Hugging Face BERT folder or Hub id, or a "
                          "tacl_jax pre-training workdir")
    if not is_pretraining_workdir(path):
        return path
    p = os.path.expanduser(path)
    ckpt_dir = checkpoint.checkpoint_dir(p)
    steps = [d for d in os.listdir(ckpt_dir) if d.isdigit()] if os.path.isdir(ckpt_dir) else []
    if steps:
        out = os.path.join(workdir, "init_export")
        if not os.path.isfile(os.path.join(out, "config.json")):
            from tacl_jax import convert  # pylint: disable=import-outside-toplevel
            try:
                convert.export_checkpoint(p, out, head="none", overwrite="ours")
            except ValueError:   # a BERT without a pooler (COCO-LM's main model)
                convert.export_checkpoint(p, out, head="mlm", overwrite="ours")
        log.info("init: the latest checkpoint of %s, exported to %s", path, out)
        return out
    final = outputs.export_dir(p, "final")
    if os.path.isfile(os.path.join(final, "config.json")):
        log.info("init: the pre-training run's export %s", final)
        return final
    raise UserError(f"config.init.path={path!r} is a tacl_jax workdir without a checkpoint or export/final; "
                    "point it at a run that saved one")


def bert_config(config, folder: str, kind: str):
    """The checkpoint's architecture with the run's numerics (``model.*``; dropout < 0 = the checkpoint's)."""
    base = hf.read_config(folder)
    dtype = precision.resolve_compute_dtype(config.model.dtype, precision.platform_of(setup.run_devices(config)))
    m = config.model
    return base.replace(
        dtype=dtype, param_dtype=m.param_dtype, dropout_bits=int(m.dropout_bits),
        kernels=precision.kernels_for(precision.platform_of(setup.run_devices(config))),
        hidden_dropout_prob=base.hidden_dropout_prob if m.hidden_dropout_prob < 0 else m.hidden_dropout_prob,
        attention_probs_dropout_prob=(base.attention_probs_dropout_prob if m.attention_probs_dropout_prob < 0
                                      else m.attention_probs_dropout_prob),
        with_pooler=kind != "qa" and heads.uses_pooler(base), with_mlm_head=False, with_nsp_head=False)


# ----------------------------------------------------------------------------- optimizer

def hf_decay_mask(params):
    """True where ``transformers``' Trainer applies weight decay: all but biases and LayerNorm
    parameters (attention biases here are 2-D, so ``optimizer.decay_mask``'s ndim rule would
    decay them)."""
    def decays(path, _):
        names = [str(getattr(k, "key", k)) for k in path]
        return names[-1] != "bias" and not any("norm" in n.lower() for n in names)
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(optim_cfg, total_steps: int):
    """AdamW (``optim_cfg`` as ``config.optim`` of pre-training) with linear warm-up/decay to 0."""
    schedule = optim_lib.learning_rate_schedule(optim_cfg.learning_rate, total_steps,
                                                optim_lib.warmup_steps(optim_cfg, total_steps))
    build = optim_lib.fused_adamw if optim_cfg.fused else optim_lib.optax_adamw
    return build(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay,
                 clip_norm=optim_cfg.clip_norm, mask=hf_decay_mask), schedule


# ----------------------------------------------------------------------------- steps

def make_train_step(model, kind: str, tx, schedule, seed: int):
    """``(state, batch) -> (state, {'loss', 'grad_norm', 'lr'})``; dropout keys from (seed, step)."""
    def train_step(state: TrainState, batch: dict):
        rng = jax.random.fold_in(jax.random.key(seed), state.step)

        def loss_fn(params):
            return heads.loss_and_outputs(model, kind, params, batch, deterministic=False, rng=rng)[0]
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
        return new, {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
    return train_step


def make_eval_step(model, kind: str):
    """``(params, batch) -> (summed loss over real rows, outputs)``."""
    def eval_step(params, batch):
        loss, out = heads.loss_and_outputs(model, kind, params, batch, deterministic=True)
        return loss * jnp.sum(batch["weights"]), out
    return eval_step


@dataclasses.dataclass
class Run:
    """What the loop and the evaluation share."""
    config: object
    task: tasks.Task
    model: nn.Module
    mesh: object
    rules: tuple
    state_sh: TrainState
    train_step: object
    eval_step: object

    def local_rows(self, batch: dict) -> dict:
        """This process's rows of a global host batch (processes feed equal slices, in order)."""
        n, p, i = len(batch["weights"]), jax.process_count(), jax.process_index()
        return {k: v[i * n // p:(i + 1) * n // p] for k, v in batch.items()}

    def put(self, batch: dict) -> dict:
        return parallel.global_batch(self.local_rows(batch), self.mesh)

    def outputs(self, params, arrays: dict, keys) -> tuple[float, list[np.ndarray]]:
        """``(summed loss, [outputs concatenated over rows])`` of ``arrays`` in eval batches."""
        loss, outs = 0.0, []
        for batch, real in data_lib.eval_batches({k: arrays[k] for k in keys}, self.config.eval_batch_size):
            with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
                l, out = self.eval_step(params, self.put(batch))
            out = out if isinstance(out, tuple) else (out,)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
                out = multihost_utils.process_allgather(out, tiled=True)
            loss += float(l)
            outs.append([np.asarray(o)[:real] for o in out])
        return loss, [np.concatenate(parts) for parts in zip(*outs)]


# ----------------------------------------------------------------------------- evaluation

def evaluate(run: Run, params, eval_sets: list) -> dict[str, float]:
    """``eval_*`` metrics (run_glue.py/run_qa.py names) over every validation set."""
    out = {}
    keys = ("input_ids", "attention_mask", "token_type_ids")
    for suffix, ev in eval_sets:
        if run.task.kind == "qa":
            feats, ex = ev
            _, (start, end) = run.outputs(params, feats, keys)
            preds = squad.decode(start, end, feats, ex["context"], run.config.qa.n_best_size,
                                 run.config.qa.max_answer_length)
            found = squad.squad_metrics(preds, ex["answer_texts"])
            n = len(ex["context"])
        else:
            loss, (logits,) = run.outputs(params, ev, keys + ("labels",))
            preds = logits[:, 0] if run.task.kind == "regression" else logits.argmax(-1)
            found = {"loss": loss / max(1, len(ev["labels"])), **metrics.compute(run.task.metrics, preds, ev["labels"])}
            n = len(ev["labels"])
        out.update({f"eval_{k}{suffix}": float(v) for k, v in found.items()})
        out[f"eval_samples{suffix}"] = n
    return out


# ----------------------------------------------------------------------------- data

def _validation_split(config, task, default: str) -> str:
    return config.data.validation_split or default


def load_data(config, task: tasks.Task, tok):
    """``(task with its labels, train arrays, [(metric suffix, eval set)])``; a QA eval set is
    ``(features, examples)``."""
    d = config.data
    if d.hf_dataset == "glue" and not d.hf_config and task.hf_config:
        with d.unlocked():
            d.hf_config = task.hf_config
    train_rows = data_lib.load_split(d, d.train_split, "train_file")
    if d.max_train_samples > 0:
        train_rows = train_rows[:d.max_train_samples]
    where = d.train_file or f"{d.hf_dataset}/{d.hf_config}:{d.train_split}"
    if task.kind == "classification" and not task.labels:
        data_lib.check_columns(train_rows, [task.label_column], where)
        labels = data_lib.infer_labels(train_rows, task.label_column)
        metric_names = tuple(d.metrics) or (("accuracy", "f1") if len(labels) == 2 else ("accuracy",))
        task = dataclasses.replace(task, labels=labels, metrics=metric_names)
        log.info("labels of %s (sorted train values): %s", where, list(labels))
    files = [("", "validation_file", task.validation_splits[0][0])]
    if len(task.validation_splits) > 1:
        files.append((task.validation_splits[1][1], "validation_mismatched_file", task.validation_splits[1][0]))
    eval_sets = []
    for n, (suffix, key, split) in enumerate(files):
        if n > 0 and not d[key] and not d.hf_dataset:
            continue   # mnli's mismatched split is optional with files
        rows = data_lib.load_split(d, _validation_split(config, task, split) if n == 0 else split, key)
        if d.max_eval_samples > 0:
            rows = rows[:d.max_eval_samples]
        where_eval = d[key] or f"{d.hf_dataset}/{d.hf_config}:{split}"
        if task.kind == "qa":
            ex = data_lib.qa_examples(rows, d, where_eval)
            feats = squad.features(tok, ex["question"], ex["context"], config.max_len, config.qa.doc_stride)
            eval_sets.append((suffix, (feats, ex)))
        else:
            eval_sets.append((suffix, data_lib.encode_classification(tok, rows, task, config.max_len, where_eval)))
    if task.kind == "qa":
        ex = data_lib.qa_examples(train_rows, d, where)
        train = squad.features(tok, ex["question"], ex["context"], config.max_len, config.qa.doc_stride,
                               ex["answer_start"], ex["answer_text"])
        train = {k: v for k, v in train.items() if k not in ("offsets", "example_index")}
    else:
        train = data_lib.encode_classification(tok, train_rows, task, config.max_len, where)
    return task, train, eval_sets


# ----------------------------------------------------------------------------- the run

def total_steps(config, num_rows: int) -> tuple[int, int]:
    """``(steps, steps per epoch)``."""
    b = config.global_batch_size
    per_epoch = num_rows // b
    if per_epoch < 1:
        raise ConfigError(f"{num_rows} training rows are fewer than global_batch_size {b}; lower "
                          "config.global_batch_size")
    steps = int(config.num_train_steps) if config.num_train_steps > 0 else \
        max(1, int(math.ceil(config.num_train_epochs * per_epoch)))
    return steps, per_epoch


def check_config(config, mesh) -> None:
    """Batches against the data-parallel devices and the processes (each feeds an equal slice)."""
    dp, procs = parallel.data_parallel_size(mesh), jax.process_count()
    for name in ("global_batch_size", "eval_batch_size"):
        if config[name] % dp or config[name] % procs:
            raise ConfigError(f"config.{name}={config[name]} is not divisible by the data-parallel size {dp} "
                              f"and the {procs} processes; use a multiple of {dp * procs}")


def finetune(config, workdir: str) -> dict:
    """Fine-tune, evaluate, write ``workdir/results.json``; returns the results."""
    from tacl_jax.data.tokenization import load_tokenizer  # pylint: disable=import-outside-toplevel
    from tacl_jax.train import start  # pylint: disable=import-outside-toplevel

    from tacl_jax.finetune.config import validate  # pylint: disable=import-outside-toplevel

    t0 = time.time()
    validate(config)
    task = tasks.get_task(config)
    if "://" not in workdir and jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
    lock = start.hold_workdir(workdir)
    try:
        folder_or_id = resolve_init(config.init.path, workdir)
        folder = hf.resolve(folder_or_id)
        tok = load_tokenizer(config.init.tokenizer_path or folder)
        task, train, eval_sets = load_data(config, task, tok)
        cfg = bert_config(config, folder, task.kind)
        if config.max_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_len {config.max_len} exceeds the model's max_position_embeddings "
                              f"{cfg.max_position_embeddings}; lower config.max_len")
        model = heads.build_model(cfg, task.kind, task.num_labels, config.model.classifier_dropout)
        n_train = len(train["input_ids"])
        steps, per_epoch = total_steps(config, n_train)
        mesh = parallel.make_mesh(dict(config.mesh), setup.run_devices(config))
        rules = parallel.rules_from_config(config.logical_axis_rules)
        check_config(config, mesh)
        tx, schedule = make_optimizer(config.optim, steps)
        abstract, state_sh = setup.state_shardings(model, tx, mesh, rules, config.max_len)
        batch_sh = {k: parallel.batch_sharding(mesh, 1 if k in _ROW_KEYS else 2) for k in train}
        batch_sh["weights"] = parallel.batch_sharding(mesh, 1)
        repl = parallel.replicated(mesh)
        run = Run(config=config, task=task, model=model, mesh=mesh, rules=rules, state_sh=state_sh,
                  train_step=jax.jit(make_train_step(model, task.kind, tx, schedule, config.seed),
                                     in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl),
                                     donate_argnums=(0,)),
                  eval_step=jax.jit(make_eval_step(model, task.kind)))

        ckpt = checkpoint.CheckpointManager(workdir, config.checkpoint)
        latest = ckpt.latest_step()
        if latest is not None:
            step0, state, _, _ = ckpt.restore_latest(abstract)
            log.info("resuming from %s/%d", ckpt.directory, step0)
        else:
            step0 = 0
            log.info("init: %s (%s head from seed %d); %d train rows, %d steps (%d per epoch)",
                     config.init.path, "qa_outputs" if task.kind == "qa" else "classifier", config.seed, n_train,
                     steps, per_epoch)
            _, bert_params = hf.load(folder, seed=config.seed,
                                     **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
            state, _ = setup.create_state(model, tx, mesh, rules, config.seed, config.max_len, bert_params, at="bert")

        console = ("loss",) + tuple(f"eval_{m}" for m in task.metrics + (("exact_match", "f1") if task.kind == "qa"
                                                                           else ()))
        writer = MetricWriter(workdir, resumed_at=step0, console_keys=console)
        stop = steps if config.steps_per_run <= 0 else min(steps, step0 + config.steps_per_run)
        pending, losses, results = [], [], {}
        for step in range(step0, stop):
            idx = data_lib.train_batch_indices(n_train, config.global_batch_size, config.seed, step)
            host = {k: v[idx] for k, v in train.items()}
            host["weights"] = np.ones(len(idx), np.float32)
            with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
                state, m = run.train_step(state, run.put(host))
            pending.append(m)
            done = step + 1
            if done % config.log_every == 0 or done == steps:
                got = jax.device_get(pending)
                pending = []
                loss = float(np.mean([g["loss"] for g in got]))
                if not math.isfinite(loss):
                    raise NonFiniteLossError(f"the loss is {loss} at step {done}; lower config.optim.learning_rate")
                losses.extend(float(g["loss"]) for g in got)
                writer.write(done, {"loss": loss, "grad_norm": float(got[-1]["grad_norm"]),
                                    "lr": float(got[-1]["lr"]), "epoch": done / per_epoch}, steps)
            if ckpt.should_save(done) and done < stop:
                ckpt.save(done, state, {"step": done}, config)
            if config.eval_every > 0 and done % config.eval_every == 0 and done < steps:
                writer.write(done, evaluate(run, state.params, eval_sets), steps)
        if stop > step0 or latest is None:
            # The metrics of steps after the last logged one are not logged by a run that stops
            # here (the resumed run logs from its own start): checkpoint at a log_every multiple.
            ckpt.save(stop, state, {"step": stop}, config, force=True)
        ckpt.wait()
        ckpt.close()
        if stop < steps:
            log.info("stopped after steps_per_run=%d at step %d of %d (checkpointed; rerun to continue)",
                     config.steps_per_run, stop, steps)
            writer.close()
            return {"status": "partial", "step": stop}
        results = evaluate(run, state.params, eval_sets)
        writer.write(steps, results, steps)
        writer.close()
        if config.export_at_end:
            tok_from = config.init.tokenizer_path or folder
            out = outputs.publish_export(workdir, "final", lambda d: export_lib.save(
                model, state.params, d, task, tokenizer_from=tok_from, overwrite="ours"))
            log.info("exported the fine-tuned model as a Hugging Face %s folder: %s",
                     export_lib.architecture(model.config, task.kind), out)
        results.update({"epoch": steps / per_epoch, "train_steps": steps, "train_samples": n_train,
                        "train_loss": float(np.mean(losses)) if losses else None,
                        "train_runtime": round(time.time() - t0, 1), "task": task.name, "seed": config.seed,
                        "init": config.init.path})
        if jax.process_index() == 0:
            path = os.path.join(outputs.local_dir(workdir), config.results_file)
            with open(path, "w") as f:
                json.dump(results, f, indent=2, sort_keys=True)
            print(table_header(task))
            print(table_row(task, results))
        return {"status": "done", **results}
    finally:
        lock.release()


_ROW_KEYS = ("labels", "start_positions", "end_positions", "weights")


def _metric_keys(task) -> list[str]:
    names = ["exact_match", "f1"] if task.kind == "qa" else list(task.metrics)
    return [f"eval_{m}{sfx}" for _, sfx in task.validation_splits for m in names]


def table_header(task) -> str:
    keys = _metric_keys(task)
    return "| task | init | seed | steps | " + " | ".join(keys) + " |\n|" + "---|" * (4 + len(keys))


def table_row(task, results: dict) -> str:
    """One README-table row: task, init, seed, steps, then the task's metrics (4 decimals)."""
    vals = [f"{results[k]:.4f}" if k in results else "–" for k in _metric_keys(task)]
    init = os.path.basename(str(results["init"]).rstrip("/")) or results["init"]
    return f"| {task.name} | {init} | {results['seed']} | {results['train_steps']} | " + " | ".join(vals) + " |"
