"""Loads a benchmark script of ``bench/`` (scripts, not a package) as a module for its tests."""

import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str):
    """The module ``bench/<name>.py``."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
