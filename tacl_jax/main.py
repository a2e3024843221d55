"""Entry point: ``python -m tacl_jax.main --config=configs/base.py --workdir=DIR [--config.x.y=v]``."""

from __future__ import annotations

import logging
import os
import re
import sys

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory (local or gs://) for metrics, checkpoints and exports.")
flags.mark_flags_as_required(["config", "workdir"])


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with an unknown ``--config.x.y`` key as one line naming the path and
    the nearest keys. ml_collections raises a bare ``AttributeError: 'lr'`` (``KeyError`` for an
    unknown group) from inside the config flag's parser, which has no path to report."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError):
        errors = unknown_overrides(argv)
        if not errors:
            raise
        for error in errors:
            print(f"FATAL Flags parsing error: {error}", file=sys.stderr)
        sys.exit(1)


def unknown_overrides(argv: list[str]) -> list[str]:
    """One line (``tacl_jax.config.unknown_key``) per ``--config.x.y`` override of ``argv`` that
    names no key of the ``--config`` file's config; [] when they all do or the config cannot be
    loaded (the original error then stands)."""
    from tacl_jax.config import unknown_key

    args = FLAGS.read_flags_from_files(argv[1:], force_gnu=False)   # --flagfile, as ml_collections reads
    source = None
    for i, arg in enumerate(args):
        match = re.fullmatch(r"--?config(?:=(.*))?", arg, re.DOTALL)
        if match:
            source = match.group(1) if match.group(1) is not None else (args[i + 1] if i + 1 < len(args) else None)
    paths = [m.group(1) for m in (re.match(r"--?(?:no)?config\.([^=]+)", a) for a in args) if m]
    if source is None or not paths:
        return []
    try:
        config = FLAGS["config"].parser.parse(source)
    except Exception:  # pylint: disable=broad-except  # the config itself fails: report that error instead
        return []
    errors = [unknown_key(config, path) for path in dict.fromkeys(paths)]
    return [e for e in errors if e]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; overrides look like --config.x.y=v")
    import jax

    from tacl_jax import parallel

    # Before anything touches the backend (the log prefix below asks for the process index).
    parallel.maybe_initialize_distributed(FLAGS.config.distributed)
    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"%(asctime)s [p{jax.process_index()}] %(name)s: %(message)s")
    # Orbax and grain log every save phase at INFO through absl; keep the console readable.
    logging.getLogger("absl").setLevel(logging.WARNING)
    from tacl_jax import hostenv

    logging.getLogger(__name__).info("allocator: %s", hostenv.describe(os.environ))
    from tacl_jax.train.loop import train_and_evaluate

    from tacl_jax.errors import UserError

    try:
        result = train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except UserError as e:   # said in one line with its fix; a traceback would only bury it
        logging.getLogger(__name__).error("%s", e)
        sys.exit(1)
    text = FLAGS.config.demo_fill_mask
    if text and result["status"] != "preempted" and jax.process_index() == 0:
        _show_fill_mask(FLAGS.workdir, text)


def _show_fill_mask(workdir: str, text: str) -> None:
    """Load the final export with ``transformers`` and print a fill-mask example."""
    from tacl_jax.hf import fill_mask
    from tacl_jax.train.outputs import export_dir, local_dir

    path = export_dir(local_dir(workdir if "://" in workdir else os.path.abspath(workdir)), "final")
    try:
        top = fill_mask(path, text)
    except ImportError:
        print(f"(install torch to run the fill-mask example on {path})")
        return
    print(f"\nfill-mask with transformers.AutoModelForMaskedLM from {path}:\n  {text}")
    for token, p in top:
        print(f"  {token:>15s}  {p:.3f}")


if __name__ == "__main__":
    from tacl_jax import signals

    # First: a SIGTERM or Ctrl-C during the slow imports and start-up is then said, and exits 0.
    signals.install()
    from tacl_jax import hostenv

    hostenv.maybe_reexec("tacl_jax.main")   # an allocator that reuses XLA's step buffers
    # No TPU or GPU here: say so to jax, so that an installed libtpu (the aot extra) does not probe
    # for chips at start-up (seconds of warnings); a JAX_PLATFORMS the user set is left alone.
    if "JAX_PLATFORMS" not in os.environ and hostenv.run_platform()[0] == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    app.run(main, flags_parser=parse_flags)
