"""'builtin:python_docs': a real English corpus that ships inside CPython, no download needed.

Two parts, in this order:
1. the reference-manual topics of ``pydoc_data.topics`` (what ``help('if')`` prints), one document
   per topic (~80 documents, ~0.5 MB);
2. the docstrings of the standard library's ``.py`` files (modules, classes, functions), read with
   ``ast`` -- nothing is imported, so no module's side effects run -- one document per docstring of
   at least ``MIN_DOCSTRING_CHARS`` characters, exact duplicates dropped (~6,000 documents, ~1.5 MB).

Paragraphs (blank-line separated) are re-flowed into one line each, since the source wraps lines
at ~72 columns; rule lines such as ``*****`` are dropped. Files are visited in sorted order, so the
corpus is identical on every machine with the same Python version (about 0.5 M BERT tokens).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import sysconfig
from collections.abc import Iterator

from tacl_jax.data import preprocess

MIN_DOCSTRING_CHARS = 40
# Not library prose: tests, bundled third-party code, the IDE, demos, and pydoc_data itself
# (already part 1).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                        "turtledemo", "ensurepip", "pydoc_data", "__pycache__"})
_RULE = re.compile(r"^[\W_]+$")  # '*****', '=====', '-----', '~~~'


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, each re-flowed into one cleaned line."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [preprocess.clean_line(x) for x in block.splitlines()]
        line = " ".join(x for x in lines if x and not _RULE.match(x))
        if line:
            out.append(line)
    return out


def _docstrings(path: str) -> Iterator[str]:
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return  # A few stdlib files are intentionally not parseable by this Python version.
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                yield doc


def _stdlib_files(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


@functools.lru_cache(maxsize=1)
def documents() -> tuple[tuple[str, ...], ...]:
    """The corpus: a tuple of documents, each a tuple of cleaned, non-empty lines."""
    from pydoc_data import topics  # pylint: disable=import-outside-toplevel

    docs = []
    for key in sorted(topics.topics):
        paragraphs = _paragraphs(topics.topics[key])
        if paragraphs:
            docs.append(tuple(paragraphs))
    seen = set()
    for path in _stdlib_files(sysconfig.get_paths()["stdlib"]):
        for doc in _docstrings(path):
            if doc in seen:
                continue
            seen.add(doc)
            paragraphs = _paragraphs(doc)
            if paragraphs:
                docs.append(tuple(paragraphs))
    return tuple(docs)
