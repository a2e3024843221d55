"""Entry point: ``python -m tacl_jax.main --config=configs/base.py --workdir=DIR [--config.x.y=v]``."""

from __future__ import annotations

import logging

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory (local or gs://) for metrics, checkpoints and exports.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; overrides look like --config.x.y=v")
    import jax

    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"%(asctime)s [p{jax.process_index()}] %(name)s: %(message)s")
    from tacl_jax.train.loop import train_and_evaluate

    train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
