"""``python -m tacl_jax.finetune --config=configs/finetune.py --workdir=DIR [--config.x.y=v]``.

The same command line as ``python -m tacl_jax.main`` (its flag parsing: an unknown override is one
line naming the nearest key); a ``UserError`` is one log line and exit status 1."""

from __future__ import annotations

import logging
import os
import sys

from absl import app

from tacl_jax.main import FLAGS, parse_flags


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; overrides look like --config.x.y=v")
    import jax

    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"%(asctime)s [p{jax.process_index()}] %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    from tacl_jax.errors import UserError
    from tacl_jax.finetune.train import finetune

    try:
        finetune(FLAGS.config, FLAGS.workdir)
    except UserError as e:   # one line with its fix
        logging.getLogger("tacl_jax.finetune").error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    from tacl_jax import hostenv, signals

    signals.install()
    if "JAX_PLATFORMS" not in os.environ and hostenv.run_platform()[0] == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    app.run(main, flags_parser=parse_flags)
