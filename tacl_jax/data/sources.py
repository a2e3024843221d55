"""Document sources: turn ``config.data.source`` into a stream of cleaned documents.

Every source yields ``(doc_index, lines)`` pairs, where ``lines`` is a non-empty list of cleaned,
non-empty lines and ``doc_index`` a stable position in the corpus. Sharding is round-robin on that
index (``doc_index % shard_count == shard_index``), so the shards are disjoint, cover the corpus,
and do not depend on how many workers read them.

Source strings (see :mod:`tacl_jax.data.config`): ``text:PATTERNS``, ``tfds:NAME``,
``builtin:python_docs``; ``synthetic`` and ``prepared:DIR`` are not document sources and are
handled by :mod:`tacl_jax.data.pipeline`.
"""

from __future__ import annotations

import abc
import dataclasses
import glob
import gzip
import json
import logging
import os
from collections.abc import Iterator

from tacl_jax.data import preprocess
from tacl_jax.data import python_docs

BUILTIN_CORPORA = ("python_docs",)
SOURCE_KINDS = ("synthetic", "text", "tfds", "builtin", "prepared")
_REPLACEMENT_CHAR_UTF8 = "\ufffd".encode()


def parse_source(source: str) -> tuple[str, str]:
    """``'text:/a/*.txt'`` -> ``('text', '/a/*.txt')``; ``'synthetic'`` -> ``('synthetic', '')``."""
    kind, sep, arg = source.partition(":")
    if kind == "synthetic" and not arg:
        return kind, ""
    if kind in SOURCE_KINDS and sep and arg:
        return kind, arg
    hint = ""
    if os.path.exists(source) or any(c in source for c in "*?["):
        hint = f" For local files write 'text:{source}'."
    raise ValueError(
        f"config.data.source={source!r} is not a data source. Use 'synthetic', "
        "'text:/path/*.txt[,more]', 'tfds:name/config', 'builtin:python_docs' or "
        f"'prepared:/dir/written/by/prepare'.{hint}")


@dataclasses.dataclass
class SourceStats:
    """What reading a source had to repair; reported once, by shard 0."""
    replaced_bytes: int = 0  # Undecodable bytes replaced by U+FFFD.
    huge_lines: int = 0  # Lines over preprocess.HUGE_LINE_CHARS characters.


class DocumentSource(abc.ABC):
    """A corpus readable as a sequence of documents, shardable round-robin."""

    def __init__(self, description: str):
        self.description = description
        self.stats = SourceStats()

    @abc.abstractmethod
    def documents(self, shard_index: int = 0,
                  shard_count: int = 1) -> Iterator[tuple[int, list[str]]]:
        """Yields ``(doc_index, lines)`` for the documents with ``doc_index % count == index``."""


def open_source(data_config) -> DocumentSource:
    """The document source named by ``data_config.source`` (text, tfds or builtin)."""
    kind, arg = parse_source(data_config.source)
    if kind == "text":
        return TextFiles(arg, doc_separator=data_config.text_doc_separator,
                         text_field=data_config.text_field)
    if kind == "tfds":
        return TfdsText(arg, data_dir=data_config.data_dir, text_field=data_config.text_field)
    if kind == "builtin":
        return Builtin(arg)
    raise ValueError(f"config.data.source={data_config.source!r} is not a text source")


# --------------------------------------------------------------------------------------------------
# Local text files.


def expand_patterns(patterns: str) -> list[str]:
    """Comma-separated paths/globs -> sorted, de-duplicated file list.

    Raises FileNotFoundError naming the path or glob that matched nothing.
    """
    files = []
    for pattern in (p.strip() for p in patterns.split(",")):
        if not pattern:
            continue
        pattern = os.path.expanduser(pattern)
        if any(c in pattern for c in "*?["):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(
                    f"config.data.source: the glob {pattern!r} matched no files. Check the "
                    "directory and the extension (.txt, .txt.gz, .jsonl, .jsonl.gz).")
            files.extend(matches)
        elif os.path.isdir(pattern):
            raise FileNotFoundError(
                f"config.data.source: {pattern!r} is a directory; name its files with a glob, "
                f"e.g. 'text:{os.path.join(pattern, '*.txt')}'.")
        elif not os.path.isfile(pattern):
            raise FileNotFoundError(
                f"config.data.source: no such file {pattern!r}. Fix the path, or use a glob.")
        else:
            files.append(pattern)
    if not files:
        raise FileNotFoundError(f"config.data.source: {patterns!r} names no files")
    return list(dict.fromkeys(files))


class TextFiles(DocumentSource):
    """``.txt`` / ``.jsonl`` files, optionally ``.gz``; documents numbered across files in order.

    Plain text: documents separated by blank lines (``doc_separator='blank_line'``) or one per line
    (``'line'``). JSONL: one document per record, its ``text_field`` split into lines.
    Undecodable bytes are replaced by U+FFFD and counted; a warning names the file.
    """

    def __init__(self, patterns: str, *, doc_separator: str = "blank_line",
                 text_field: str = "text"):
        self.files = expand_patterns(patterns)
        super().__init__(f"text files {patterns!r} ({len(self.files)} files)")
        self.doc_separator = doc_separator
        self.text_field = text_field

    def documents(self, shard_index=0, shard_count=1):
        index = 0
        for path in self.files:
            for lines in self._file_documents(path, report=shard_index == 0):
                if index % shard_count == shard_index:
                    yield index, lines
                index += 1

    def _raw_lines(self, path: str) -> Iterator[bytes]:
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rb") as f:
                yield from f
        except (gzip.BadGzipFile, EOFError, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise ValueError(f"cannot read {path!r}: {e}. A .gz file must be gzip-compressed and "
                             "complete; re-compress it or drop the .gz extension.") from e

    def _decoded_lines(self, path: str, report: bool) -> Iterator[tuple[int, str]]:
        replaced = huge = 0
        for lineno, raw in enumerate(self._raw_lines(path), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line = raw.decode("utf-8", errors="replace")
                replaced += line.count("\ufffd") - raw.count(_REPLACEMENT_CHAR_UTF8)
            if len(line) > preprocess.HUGE_LINE_CHARS:
                huge += 1
                if report and huge == 1:
                    logging.warning(
                        "%s:%d is %d characters long: probably not line-broken text. It is cut "
                        "into sentences and row-sized pieces; if sentences matter, add line breaks.",
                        path, lineno, len(line))
            yield lineno, line
        if report:
            self.stats.replaced_bytes += replaced
            self.stats.huge_lines += huge
            if replaced:
                logging.warning(
                    "%s: %d bytes are not valid UTF-8 and were replaced by U+FFFD. If the file is "
                    "in another encoding, convert it first (e.g. iconv -f latin1 -t utf-8).",
                    path, replaced)

    def _file_documents(self, path: str, report: bool) -> Iterator[list[str]]:
        is_jsonl = path.endswith((".jsonl", ".jsonl.gz"))
        doc: list[str] = []
        for lineno, line in self._decoded_lines(path, report):
            if is_jsonl:
                if line.strip():
                    lines = _clean_lines(self._json_text(path, lineno, line).split("\n"))
                    if lines:
                        yield lines
                continue
            cleaned = preprocess.clean_line(line)
            if self.doc_separator == "line":
                if cleaned:
                    yield [cleaned]
            elif cleaned:
                doc.append(cleaned)
            elif doc:
                yield doc
                doc = []
        if doc:
            yield doc

    def _json_text(self, path: str, lineno: int, line: str) -> str:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno} is not valid JSON ({e.msg}). A .jsonl file holds one "
                             "JSON object per line; rename plain text to .txt.") from e
        if not isinstance(record, dict) or self.text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}:{lineno} has no field {self.text_field!r} (has {keys}). Set "
                             "--config.data.text_field to the field that holds the text.")
        text = record[self.text_field]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: field {self.text_field!r} is "
                             f"{type(text).__name__}, not a string")
        return text


def _clean_lines(lines) -> list[str]:
    return [c for c in (preprocess.clean_line(x) for x in lines) if c]


# --------------------------------------------------------------------------------------------------
# TensorFlow Datasets (ArrayRecord, read with tfds.data_source: no TensorFlow needed).


class TfdsText(DocumentSource):
    """The ``train`` split of a TFDS text dataset; one document per example's ``text_field``."""

    def __init__(self, name: str, *, data_dir: str = "", text_field: str = "text"):
        super().__init__(f"TFDS {name!r}" + (f" in {data_dir}" if data_dir else ""))
        self.name = name
        self.data_dir = data_dir or None
        self.text_field = text_field
        self._source = None

    def _open(self):
        if self._source is None:
            import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
            try:
                self._source = tfds.data_source(self.name, split="train", data_dir=self.data_dir)
            except Exception as e:  # TFDS raises several types for "not there".
                raise FileNotFoundError(
                    f"config.data.source='tfds:{self.name}': cannot open its 'train' split in "
                    f"data_dir={self.data_dir or '(TFDS default)'} ({type(e).__name__}: {e}). "
                    "Build it in ArrayRecord format first (tfds build --file_format=array_record) "
                    "or set --config.data.data_dir.") from e
        return self._source

    def __len__(self) -> int:
        return len(self._open())

    def documents(self, shard_index=0, shard_count=1):
        source = self._open()
        for index in range(shard_index, len(source), shard_count):
            example = source[index]
            if self.text_field not in example:
                raise ValueError(f"tfds:{self.name} examples have no field {self.text_field!r} "
                                 f"(fields: {sorted(example)}); set --config.data.text_field")
            text = example[self.text_field]
            if isinstance(text, bytes):
                decoded = text.decode("utf-8", errors="replace")
                if shard_index == 0:
                    self.stats.replaced_bytes += (decoded.count("\ufffd")
                                                  - text.count(_REPLACEMENT_CHAR_UTF8))
                text = decoded
            lines = _clean_lines(str(text).split("\n"))
            if lines:
                yield index, lines


# --------------------------------------------------------------------------------------------------
# Corpora embedded in the installation.


class Builtin(DocumentSource):
    """``builtin:python_docs``: see :mod:`tacl_jax.data.python_docs`."""

    def __init__(self, name: str):
        if name not in BUILTIN_CORPORA:
            raise ValueError(f"config.data.source='builtin:{name}': no such corpus; the builtin "
                             f"corpora are {['builtin:' + n for n in BUILTIN_CORPORA]}")
        super().__init__(f"builtin:{name}")

    def documents(self, shard_index=0, shard_count=1):
        docs = python_docs.documents()
        for index in range(shard_index, len(docs), shard_count):
            yield index, list(docs[index])
