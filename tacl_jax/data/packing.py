"""Packing tokenized sentences into model rows, and the rows' flat in-memory form.

A *sentence* is ``(ids int32 [n], word_starts uint8 [n])`` without special tokens. Three packers:

- :class:`FullSentencePacker` (RoBERTa FULL-SENTENCES, the default): ``[CLS] s1 s2 ... [SEP]``,
  whole sentences until the next would not fit, crossing documents with one extra ``[SEP]`` between
  them. One segment (token type 0 everywhere).
- :class:`NspPairPacker` (BERT, original TaCL): per document, chunks of whole sentences split into
  ``[CLS] A [SEP] B [SEP]``; B is the actual continuation (label 0) or, with probability 1/2 (always
  when the chunk has one sentence), a span of a random other document of the shard (label 1), and
  the chunk's unused sentences go back to the document -- BERT's ``create_instances_from_document``
  except that nothing is truncated: a chunk never exceeds the row.
- :class:`ContiguousPacker` (Hugging Face ``run_mlm``'s ``group_texts``; the rows of the TaCL effect
  study's PyTorch peer): the text in corpus order cut into rows of exactly the target length,
  wherever the row fills, mid-sentence or mid-word, documents joined by one ``[SEP]`` inside a row
  (none at a row's edge: a row where a document ends one token early stays one short). Next to no
  padding: ``max_len`` tokens a row, where ``full_sentences`` fills ~75% at ``max_len`` 64 on
  wikitext-2 (48.3 of 64 real tokens a row with short_seq_prob 0.1).

Invariant of all three: every corpus token is in exactly one row, in corpus order (for NSP: as A or
as an actual-continuation B; random-next B spans are copies). Sentences longer than a row are cut into
row-sized pieces; the first token of a piece is flagged as a word start so whole-word masking never
sees a row that starts inside a word.

Row lengths target ``max_len``, or with probability ``short_seq_prob`` a uniform length in
``[2, capacity]`` (BERT's short sequences). Randomness comes only from the packer's ``rng``.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

Sentence = tuple[np.ndarray, np.ndarray]  # (ids int32 [n], word_starts uint8 [n])

Row = collections.namedtuple("Row", "input_ids word_starts segment_a_len next_sentence_label")
Row.__doc__ = """One packed row: ``input_ids`` int32 [n <= max_len] with its specials, ``word_starts``
uint8 [n], ``segment_a_len`` (positions of type 0: ``[CLS] A [SEP]``, or n for one segment) and
``next_sentence_label`` (1 = B is random)."""


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Rows stored flat: row r is ``tokens[offsets[r]:offsets[r + 1]]``.

    Attributes:
      tokens: int32 ``[total]`` every row's ids, specials included, concatenated.
      word_starts: uint8 ``[total]`` 1 at the first piece of each word, 0 elsewhere.
      offsets: int64 ``[rows + 1]``.
      segment_a_len: int32 ``[rows]`` see :data:`Row`.
      next_sentence_label: int32 ``[rows]``.

    A grain random-access data source (``len`` and ``[i]`` -> :data:`Row`).
    """
    tokens: np.ndarray
    word_starts: np.ndarray
    offsets: np.ndarray
    segment_a_len: np.ndarray
    next_sentence_label: np.ndarray

    def __len__(self) -> int:
        return len(self.segment_a_len)

    def __getitem__(self, index: int) -> Row:
        start, end = self.offsets[index], self.offsets[index + 1]
        return Row(self.tokens[start:end], self.word_starts[start:end],
                   int(self.segment_a_len[index]), int(self.next_sentence_label[index]))

    def __getitems__(self, indices) -> list[Row]:
        return [self[i] for i in indices]

    @property
    def num_tokens(self) -> int:
        """Positions in all rows, specials included."""
        return int(self.offsets[-1])

    @classmethod
    def concatenate(cls, parts: list[PackedRows]) -> PackedRows:
        if not parts:
            return _RowsBuilder(0, 0).build()
        shifts = np.cumsum([0] + [p.num_tokens for p in parts[:-1]])
        return cls(
            tokens=np.concatenate([p.tokens for p in parts]),
            word_starts=np.concatenate([p.word_starts for p in parts]),
            offsets=np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]),
            segment_a_len=np.concatenate([p.segment_a_len for p in parts]),
            next_sentence_label=np.concatenate([p.next_sentence_label for p in parts]))


class _RowsBuilder:
    """Accumulates rows made of sentence pieces, then builds :class:`PackedRows` at once."""

    def __init__(self, cls_id: int, sep_id: int):
        self._cls = (np.array([cls_id], np.int32), np.zeros(1, np.uint8))
        self._sep = (np.array([sep_id], np.int32), np.zeros(1, np.uint8))
        self._pieces: list[Sentence] = []
        self._lengths: list[int] = []
        self._a_lens: list[int] = []
        self._labels: list[int] = []

    @property
    def sep(self) -> Sentence:
        return self._sep

    def add(self, a: list[Sentence], b: list[Sentence] | None = None, label: int = 0) -> None:
        """Adds ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]``."""
        row = [self._cls, *a, self._sep]
        a_len = sum(len(p[0]) for p in row)
        if b is not None:
            row += [*b, self._sep]
        self._pieces.extend(row)
        self._lengths.append(sum(len(p[0]) for p in row))
        self._a_lens.append(a_len)
        self._labels.append(label)

    def build(self) -> PackedRows:
        if not self._pieces:
            return PackedRows(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64),
                              np.zeros(0, np.int32), np.zeros(0, np.int32))
        return PackedRows(
            tokens=np.concatenate([p[0] for p in self._pieces]).astype(np.int32, copy=False),
            word_starts=np.concatenate([p[1] for p in self._pieces]).astype(np.uint8, copy=False),
            offsets=np.concatenate([[0], np.cumsum(self._lengths)]).astype(np.int64),
            segment_a_len=np.asarray(self._a_lens, np.int32),
            next_sentence_label=np.asarray(self._labels, np.int32))


def sentence_pieces(sentences: list[Sentence], limit: int) -> list[Sentence]:
    """Drops empty sentences; cuts those longer than ``limit`` into pieces of at most ``limit``.

    The first token of every piece after the first becomes a word start (see module doc).
    """
    pieces = []
    for ids, starts in sentences:
        if len(ids) <= limit:
            if len(ids):
                pieces.append((ids, starts))
            continue
        for k in range(0, len(ids), limit):
            piece_starts = starts[k:k + limit].copy()
            piece_starts[0] = 1
            pieces.append((ids[k:k + limit], piece_starts))
    return pieces


class _Packer:
    """Shared state: statistics, target lengths, the row builder."""

    def __init__(self, *, max_len: int, cls_id: int, sep_id: int, short_seq_prob: float,
                 rng: np.random.Generator, specials: int):
        if max_len < specials + 2:
            raise ValueError(f"max_len={max_len} leaves no room for text; use max_len >= "
                             f"{specials + 2}")
        self.capacity = max_len - specials  # Content tokens per row.
        self.short_seq_prob = short_seq_prob
        self.rng = rng
        self.rows = _RowsBuilder(cls_id, sep_id)
        self.num_documents = 0
        self.num_tokens = 0  # Corpus tokens (no specials).
        self.num_cut_sentences = 0  # Sentences longer than a row, cut into pieces.

    def _target(self) -> int:
        # Always draw, so the stream of random numbers does not depend on the outcome.
        short = self.rng.random() < self.short_seq_prob
        length = int(self.rng.integers(2, self.capacity + 1)) if self.capacity >= 2 else 1
        return length if short else self.capacity

    def _pieces(self, sentences: list[Sentence], limit: int) -> list[Sentence]:
        pieces = sentence_pieces(sentences, limit)
        self.num_cut_sentences += sum(1 for ids, _ in sentences if len(ids) > limit)
        if pieces:
            self.num_documents += 1
            self.num_tokens += sum(len(p[0]) for p in pieces)
        return pieces


class FullSentencePacker(_Packer):
    """``[CLS] whole sentences, documents separated by [SEP] [SEP]`` rows; streaming."""

    def __init__(self, *, max_len: int, cls_id: int, sep_id: int, short_seq_prob: float,
                 rng: np.random.Generator):
        super().__init__(max_len=max_len, cls_id=cls_id, sep_id=sep_id,
                         short_seq_prob=short_seq_prob, rng=rng, specials=2)
        self._row: list[Sentence] = []
        self._length = 0
        self._target_len = self._target()

    def add_document(self, sentences: list[Sentence]) -> None:
        pieces = self._pieces(sentences, self.capacity)
        separate = self._length > 0  # One [SEP] between documents sharing a row.
        for piece in pieces:
            extra = 1 if separate else 0
            if self._length and self._length + extra + len(piece[0]) > self._target_len:
                self._emit()
                extra = 0
            if extra:
                self._row.append(self.rows.sep)
                self._length += 1
            separate = False
            self._row.append(piece)
            self._length += len(piece[0])

    def _emit(self) -> None:
        self.rows.add(self._row)
        self._row, self._length = [], 0
        self._target_len = self._target()

    def finish(self) -> PackedRows:
        if self._row:
            self._emit()
        return self.rows.build()


class ContiguousPacker(FullSentencePacker):
    """``[CLS] the next target-length tokens [SEP]`` rows, cut anywhere; streaming."""

    def add_document(self, sentences: list[Sentence]) -> None:
        sentences = [s for s in sentences if len(s[0])]
        if not sentences:
            return
        self.num_documents += 1
        self.num_tokens += sum(len(ids) for ids, _ in sentences)
        separate = self._length > 0     # the [SEP] between documents, only where both sides share a row
        for ids, starts in sentences:
            k = 0
            while k < len(ids):
                if separate:
                    if self._target_len - self._length >= 2:
                        self._row.append(self.rows.sep)
                        self._length += 1
                    else:
                        self._emit()
                    separate = False
                take = min(self._target_len - self._length, len(ids) - k)
                piece_starts = starts[k:k + take]
                if self._length == 0 and not piece_starts[0]:
                    # A row that starts inside a word: whole-word masking sees a word start (module doc).
                    piece_starts = piece_starts.copy()
                    piece_starts[0] = 1
                self._row.append((ids[k:k + take], piece_starts))
                self._length += take
                k += take
                if self._length == self._target_len:
                    self._emit()


class NspPairPacker(_Packer):
    """``[CLS] A [SEP] B [SEP]`` rows with next-sentence labels; needs the whole shard in memory."""

    def __init__(self, *, max_len: int, cls_id: int, sep_id: int, short_seq_prob: float,
                 rng: np.random.Generator):
        super().__init__(max_len=max_len, cls_id=cls_id, sep_id=sep_id,
                         short_seq_prob=short_seq_prob, rng=rng, specials=3)
        self._docs: list[list[Sentence]] = []

    def add_document(self, sentences: list[Sentence]) -> None:
        # Pieces leave at least one position for B.
        pieces = self._pieces(sentences, self.capacity - 1)
        if pieces:
            self._docs.append(pieces)

    def finish(self) -> PackedRows:
        for d in range(len(self._docs)):
            self._pack_document(d)
        self._docs = []
        return self.rows.build()

    def _pack_document(self, d: int) -> None:
        pieces = self._docs[d]
        chunk: list[Sentence] = []
        length = 0
        target = self._target()
        i = 0
        while i < len(pieces):
            chunk.append(pieces[i])
            length += len(pieces[i][0])
            last = i == len(pieces) - 1
            if last or length + len(pieces[i + 1][0]) > target:
                a_end = int(self.rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
                a = chunk[:a_end]
                if len(chunk) == 1 or self.rng.random() < 0.5:
                    a_len = sum(len(p[0]) for p in a)
                    b = self._random_span(d, max(1, target - a_len))
                    self.rows.add(a, b, label=1)
                    i -= len(chunk) - a_end  # The unused sentences go back to the document.
                else:
                    self.rows.add(a, chunk[a_end:], label=0)
                chunk, length = [], 0
                target = self._target()
            i += 1

    def _random_span(self, d: int, length: int) -> list[Sentence]:
        """``length`` tokens (fewer if the document ends) from a random sentence of another
        document of the shard (of the same document if it is the only one)."""
        other = d
        if len(self._docs) > 1:
            for _ in range(10):  # As BERT: a few tries, then accept what we have.
                other = int(self.rng.integers(0, len(self._docs)))
                if other != d:
                    break
        pieces = self._docs[other]
        span, have = [], 0
        for ids, starts in pieces[int(self.rng.integers(0, len(pieces))):]:
            take = min(len(ids), length - have)
            span.append((ids[:take], starts[:take]))
            have += take
            if have >= length:
                break
        return span


def make_packer(packing: str, *, max_len: int, cls_id: int, sep_id: int, short_seq_prob: float,
                rng: np.random.Generator) -> FullSentencePacker | NspPairPacker:
    """The packer for ``config.data.packing``."""
    cls = {"full_sentences": FullSentencePacker, "nsp_pairs": NspPairPacker,
           "contiguous": ContiguousPacker}.get(packing)
    if cls is None:
        raise ValueError(f"config.data.packing={packing!r}: use 'full_sentences', 'nsp_pairs' or 'contiguous'")
    return cls(max_len=max_len, cls_id=cls_id, sep_id=sep_id, short_seq_prob=short_seq_prob,
               rng=rng)
