"""``python -m tacl_jax.convert to_hf``: what it does with an ``--out`` that is taken.

The export itself (checkpoint -> transformers) is tested end to end in test_checkpoint.py; the
folder semantics (``overwrite``) in test_hf.py. These tests need no checkpoint: ``--out`` is
checked before the restore, so a refused ``--out`` costs nothing.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from tacl_jax import hf
from tacl_jax.convert import export_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _convert(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tacl_jax.convert", "to_hf", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def _taken(path):
    """A folder with another model in it: what `--out` must never be merged into."""
    path.mkdir()
    (path / "pytorch_model.bin").write_bytes(b"old weights")
    (path / "vocab.txt").write_text("[PAD]\n")
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_taken_out_is_refused_before_the_checkpoint_is_read(tmp_path):
    out = tmp_path / "hf"
    before = _taken(out)
    # The workdir does not exist: the refusal of --out comes first, so nothing was restored.
    with pytest.raises(hf.ExportDirError, match=f"{out} already exists and is not empty.*--overwrite"):
        export_checkpoint(str(tmp_path / "no_run"), str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_cli_one_line_errors_for_a_taken_out_and_overwrite_reaches_the_check(tmp_path):
    out, run = tmp_path / "hf", tmp_path / "no_run"
    before = _taken(out)
    res = _convert(f"--workdir={run}", f"--out={out}")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith(f"tacl_jax.convert: error: {out} already exists")
    assert "--overwrite" in res.stderr and "Traceback" not in res.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # With --overwrite the folder passes the check and the run's absence is what stops it,
    # still before anything is written.
    res = _convert(f"--workdir={run}", f"--out={out}", "--overwrite")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"is {str(run)!r} a tacl_jax workdir" in res.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_cli_out_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"keep me")
    res = _convert(f"--workdir={tmp_path / 'no_run'}", f"--out={f}")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"tacl_jax.convert: error: {f} exists and is a file" in res.stderr
    assert f.read_bytes() == b"keep me"
