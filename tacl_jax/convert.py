"""Export a training checkpoint as a Hugging Face folder.

    python -m tacl_jax.convert to_hf --workdir=DIR [--step=N] --out=DIR [--head=mlm|none] [--overwrite]

``--head=mlm`` (default) writes a ``BertForMaskedLM`` folder (``AutoModelForMaskedLM``);
``--head=none`` a ``BertModel`` folder (``AutoModel``; TaCL's release format). A run from a RoBERTa
or ELECTRA checkpoint exports in its family (``RobertaForMaskedLM``/``RobertaModel``,
``ElectraForMaskedLM``/``ElectraModel``). Safetensors only,
vocabulary padding stripped, tokenizer files copied from the run's tokenizer folder. Runs on a
CPU host for checkpoints trained on a pod: the sharded checkpoint is restored onto the local
devices.

``--out`` must be absent or an empty folder; an existing export (or any folder) is replaced whole
only with ``--overwrite`` (never merged: old weights or tokenizer files beside new ones crash
``transformers``). The folder appears complete or not at all (see ``hf.save``).
"""

from __future__ import annotations

import logging
import os
import sys

import jax
import ml_collections
from absl import app, flags

from tacl_jax import checkpoint, hf, parallel
from tacl_jax.errors import UserError
from tacl_jax.train.optimizer import make_optimizer

log = logging.getLogger(__name__)


def export_checkpoint(workdir: str, out: str, step: int | None = None, head: str = "mlm",
                      overwrite: bool | str = False) -> str:
    """Restore ``workdir``'s checkpoint ``step`` (default: the latest) and write it to ``out``
    (``overwrite`` as in ``hf.save``: an existing non-empty ``out`` is refused unless True)."""
    if head not in ("mlm", "none"):
        raise ValueError(f"--head={head!r}: use 'mlm' (BertForMaskedLM) or 'none' (BertModel)")
    hf.check_out_dir(out, overwrite)  # before the restore: a refused --out should cost nothing
    from tacl_jax.train import objective as objective_lib, setup  # the run's builders: shapes match exactly
    ckpt_dir = checkpoint.checkpoint_dir(workdir)
    if not os.path.isdir(ckpt_dir) and "://" not in workdir:
        raise FileNotFoundError(f"{ckpt_dir} does not exist: is {workdir!r} a tacl_jax workdir?")
    cfg_ckpt = ml_collections.ConfigDict({"every": 0, "keep": 1, "keep_every": 0, "async_save": False})
    mgr = checkpoint.CheckpointManager(workdir, cfg_ckpt)
    steps = mgr.all_steps()
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {ckpt_dir}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"no checkpoint of step {step} in {ckpt_dir}; available: {steps}")
    config = ml_collections.ConfigDict(mgr.restore_config(step))
    model = setup.model_from_config(config)
    tx, _ = make_optimizer(config.optim, config.num_train_steps)
    mesh = parallel.make_mesh(dict(data=-1, fsdp=1, tensor=1), jax.local_devices())
    abstract, _ = setup.state_shardings(model, tx, mesh, parallel.rules_from_config(config.logical_axis_rules),
                                       config.max_len)
    state, _, _ = mgr.restore(step, abstract)
    mgr.close()
    tok = _tokenizer_folder(config.init.tokenizer_path or config.init.hf_path)
    if tok is None:
        log.warning("no tokenizer folder recorded in the run's config: the export has no tokenizer files")
    # The objective's BERT: the whole student, or a part of it (COCO-LM's main model; the
    # checkpoint holds the generator and heads too).
    objective = objective_lib.get(config.objective)
    params = objective_lib.bert_params_of(objective, model, state.params)
    model = objective_lib.bert_of(objective, model)
    # ElectraModel has no pooler: an ELECTRA run exports without one.
    if head == "none" and not model.config.with_pooler and model.config.model_type != "electra":
        raise ValueError(f"the {config.objective} run's BERT has no pooler: export it with --head=mlm")
    hf.save(model, params, out, head=head, tokenizer_from=tok, overwrite=overwrite)
    log.info("wrote step %d of %s as a Hugging Face %s folder: %s", step, workdir,
             hf.architecture_name(model.config, head), out)
    return out


def _tokenizer_folder(path_or_id: str) -> str | None:
    """The run's tokenizer folder (a folder, or a Hub id in the Hugging Face cache), or None when
    it is not on this machine or has no tokenizer files."""
    if not path_or_id:
        return None
    try:
        tok = hf.resolve(path_or_id, weights=False)
    except UserError as e:
        log.warning("the run's tokenizer %r is not readable here (%s)", path_or_id, e)
        return None
    return tok if any(os.path.isfile(os.path.join(tok, n)) for n in hf.TOKENIZER_FILES) else None


def main(argv):
    if len(argv) != 2 or argv[1] != "to_hf":
        raise app.UsageError("usage: python -m tacl_jax.convert to_hf --workdir=DIR --out=DIR [--step=N] "
                             "[--head=mlm|none] [--overwrite]")
    if not FLAGS.workdir or not FLAGS.out:
        raise app.UsageError("--workdir and --out are required")
    logging.basicConfig(level=logging.INFO, force=True, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        export_checkpoint(FLAGS.workdir, FLAGS.out, FLAGS.step, FLAGS.head, FLAGS.overwrite)
    except (UserError, FileNotFoundError) as e:
        # A taken or impossible --out, a wrong --workdir, a damaged checkpoint: the user's to fix,
        # not a bug, so one line naming the path and the fix instead of a traceback.
        print(f"tacl_jax.convert: error: {e}", file=sys.stderr)
        sys.exit(1)


def _define_flags() -> None:
    """Flags only for the command line, so that importing this module (e.g. next to
    ``tacl_jax.main``, which also has ``--workdir``) never defines them twice."""
    flags.DEFINE_string("workdir", None, "The run's workdir (local or gs://).")
    flags.DEFINE_string("out", None, "Output folder.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_enum("head", "mlm", ["mlm", "none"], "mlm: BertForMaskedLM; none: BertModel.")
    flags.DEFINE_bool("overwrite", False, "Replace an existing non-empty --out folder whole (it is "
                      "deleted only once the new export is complete). Without it such a folder is refused.")


FLAGS = flags.FLAGS

if __name__ == "__main__":
    _define_flags()
    app.run(main)
