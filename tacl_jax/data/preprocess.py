"""Text clean-up before tokenization: clean lines, split sentences, bound sentence size.

A *document* is a list of cleaned, non-empty lines. Lines are sentence boundaries (BERT's input
format is one sentence per line); inside a line a conservative regex finds more boundaries. The
packers only ever place whole sentences in a row, except sentences longer than a row, which are cut
into row-sized pieces (see :mod:`tacl_jax.data.packing`).
"""

from __future__ import annotations

import re

# Controls (not tab/newline, which become spaces), zero-width space, BOM, the C1 block.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b\ufeff]")
_SPACE = re.compile(r"\s+")
# End of sentence: . ! ? (and closing quotes/brackets), whitespace, then an upper-case letter, a
# digit or an opening quote/bracket. Misses some boundaries and splits after "e.g. The"; both only
# move a sentence boundary, never lose text.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(\s+)(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")

# Longer sentences are cut at whitespace before tokenizing, so a file without line breaks never
# becomes one multi-megabyte string for the tokenizer. Far above any real sentence.
MAX_SENTENCE_CHARS = 20_000
# A line longer than this is reported: the file is probably not line-broken text.
HUGE_LINE_CHARS = 1_000_000


def clean_line(line: str) -> str:
    """Control characters to spaces, whitespace runs to one space, stripped."""
    return _SPACE.sub(" ", _CONTROL.sub(" ", line)).strip()


def split_sentences(line: str) -> list[str]:
    """Splits a cleaned line into sentences; none is longer than MAX_SENTENCE_CHARS.

    ``" ".join(split_sentences(x)) == x`` for any cleaned ``x`` (no text is dropped).
    """
    out = []
    start = 0
    for m in _SENTENCE_END.finditer(line):
        out.append(line[start:m.start(1)])
        start = m.end(1)
    out.append(line[start:])
    return [piece for s in out if s for piece in _cut_long(s)]


def _cut_long(sentence: str) -> list[str]:
    """Cuts at the last space before each MAX_SENTENCE_CHARS boundary (hard cut if none)."""
    pieces = []
    while len(sentence) > MAX_SENTENCE_CHARS:
        cut = sentence.rfind(" ", MAX_SENTENCE_CHARS // 2, MAX_SENTENCE_CHARS)
        if cut < 0:
            pieces.append(sentence[:MAX_SENTENCE_CHARS])
            sentence = sentence[MAX_SENTENCE_CHARS:]
        else:
            pieces.append(sentence[:cut])
            sentence = sentence[cut + 1:]
    if sentence:
        pieces.append(sentence)
    return pieces


def is_eval_document(doc_index: int, eval_fraction: float) -> bool:
    """Whether document ``doc_index`` belongs to the held-out split.

    A golden-ratio (low-discrepancy) sequence: deterministic, independent of sharding, and close to
    ``eval_fraction`` even for small corpora.
    """
    if eval_fraction <= 0.0:
        return False
    return ((doc_index + 1) * 0.6180339887498949) % 1.0 < eval_fraction
