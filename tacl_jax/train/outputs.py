"""What a run leaves besides checkpoints: the Hugging Face export, the isotropy analysis, and the
local mirror of a remote workdir; and which end-of-run outputs a finished run still lacks."""

from __future__ import annotations

import json
import logging
import os
import time

import jax

from tacl_jax import hf

log = logging.getLogger(__name__)


def local_dir(workdir: str) -> str:
    """Where files that need a POSIX filesystem (appended JSONL, TensorBoard events, the export
    staging) go: the workdir itself, or for a remote one (``gs://...``) a local mirror,
    ``$TACL_LOCAL_DIR`` or ``/tmp/tacl_jax/<bucket path>``. Checkpoints go to the workdir either way."""
    if "://" not in workdir:
        return workdir
    root = os.environ.get("TACL_LOCAL_DIR", os.path.join("/tmp", "tacl_jax"))
    return os.path.join(root, workdir.split("://", 1)[1].strip("/"))


def copy_tree(src: str, dst: str) -> None:
    """Local folder -> remote folder (``gs://``) through etils/epath, subfolders included."""
    from etils import epath

    dst_path = epath.Path(dst)
    dst_path.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(src):
        if os.path.isdir(os.path.join(src, f)):
            copy_tree(os.path.join(src, f), str(dst_path / f))
        else:
            (dst_path / f).write_bytes(open(os.path.join(src, f), "rb").read())


def export_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "export", name)


def publish_export(workdir: str, name: str, write) -> str:
    """``write(folder)`` (every process calls it; process 0 writes) into ``workdir/export/name``,
    through a local staging folder (copied up) when the workdir is remote. Returns the path."""
    out = export_dir(workdir, name)
    staging = export_dir(local_dir(workdir), name)
    write(staging)
    if staging != out and jax.process_index() == 0:
        copy_tree(staging, out)
    return out


def export(model, params, workdir: str, name: str, tok_dir: str | None) -> None:
    # "ours": a rerun redoes an export it wrote (whole, atomically); a user's folder is refused.
    out = publish_export(workdir, name, lambda d: hf.save(model, params, d, head="mlm",
                                                         tokenizer_from=tok_dir or None, overwrite="ours"))
    log.info("exported the student as a Hugging Face %s folder: %s",
             hf.architecture_name(model.config, "mlm"), out)


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
        copy_tree(out, os.path.join(workdir, "analysis"))
    run = report["models"][-1]["last_layer"]
    init = f" (init {report['models'][0]['last_layer']:.4f})" if len(entries) > 1 else ""
    log.info("analysis: last-layer self-similarity %.4f%s on %d held-out sentences, %.0fs -> %s "
             "(self_similarity.json, self_similarity.png, cosine_heatmap.png)", run, init, len(sentences),
             time.perf_counter() - t0, os.path.join(workdir, "analysis"))
    return report


def step_export_missing(config, workdir: str, step: int) -> bool:
    """Whether ``step``'s ``hf_export_every`` export should exist and does not: a stop between that
    step's checkpoint and its export (the export is written after the save starts), resumed at it."""
    every = config.hf_export_every
    return every > 0 and step > 0 and step % every == 0 and not export_written(workdir, f"step_{step}")


def export_written(workdir: str, name: str) -> bool:
    """Whether the export ``name`` ("final", "step_N") is there (``hf.save`` publishes a folder whole)."""
    return os.path.isfile(os.path.join(export_dir(local_dir(workdir), name), "config.json"))


def end_outputs_missing(config, workdir: str) -> set[str]:
    """What a finished run's end should have written and did not (a crash between the last
    checkpoint and the export, an export that failed): a subset of ``{"eval", "export",
    "analysis", "step_export"}`` (the last: the ``hf_export_every`` export of the final step)."""
    todo = set()
    local = local_dir(workdir)
    if step_export_missing(config, workdir, config.num_train_steps):
        todo.add("step_export")
    if config.export_at_end and not export_written(workdir, "final"):
        todo.add("export")
    if config.eval_at_end and not has_eval_row(os.path.join(local, "metrics.jsonl"), config.num_train_steps):
        todo.add("eval")
    if config.analysis.enabled and config.export_at_end and \
            not os.path.isfile(os.path.join(local, "analysis", "self_similarity.json")):
        todo.add("analysis")
    return todo


def has_eval_row(path: str, step: int) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("step") == step and any(k.startswith("eval_") for k in row):
                return True
    return False
