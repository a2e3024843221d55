"""Small deterministic corpora and tokenizers for tests (no network, no /work/shared)."""

from __future__ import annotations

import json
import os

import numpy as np

# Common lower-case English words: single WordPiece tokens of bert-base-uncased.
WORDS = (
    "the of and to in is was for on as with by he it at from his an were are which this also be "
    "had first one their its new after who they has two her she been other when there all during "
    "into school time may years more most only over city some world would where later up such used "
    "many can state about national out known university united then made team american film game "
    "war season south music people north county between three under several river house band being "
    "while him year well part government second family early series life no each album both these "
    "through against however early group water public west since club them called would name four "
    "five local great old final church former best around small line book high following member "
    "red green blue light stone road bridge garden summer winter station village island king queen"
).split()

SPECIAL_IDS = {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}  # bert-base-uncased


def random_documents(num_docs: int, seed: int = 0, min_sentences: int = 1,
                     max_sentences: int = 8) -> list[list[str]]:
    """Documents of capitalised sentences of 4-20 words from :data:`WORDS`, one per line."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        lines = []
        for _ in range(int(rng.integers(min_sentences, max_sentences + 1))):
            words = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(4, 21)))]
            lines.append(" ".join(words).capitalize() + ".")
        docs.append(lines)
    return docs


def write_text_corpus(path: str, docs: list[list[str]]) -> str:
    """Writes documents one sentence per line, separated by blank lines; returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join("\n".join(lines) for lines in docs) + "\n")
    return path


def write_jsonl_corpus(path: str, docs: list[list[str]], field: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for lines in docs:
            f.write(json.dumps({field: "\n".join(lines), "id": len(lines)}) + "\n")
    return path


def write_toy_tokenizer(directory: str, extra_words: tuple[str, ...] = ("hello", "world")) -> str:
    """A WordPiece tokenizer with bert-base-uncased's special ids but another (tiny) vocabulary."""
    import tokenizers  # pylint: disable=import-outside-toplevel
    from tokenizers import models, normalizers, pre_tokenizers  # pylint: disable=import-outside-toplevel

    vocab = {f"[unused{i}]": i for i in range(1, 100)}
    vocab.update({"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103})
    for word in extra_words:
        vocab.setdefault(word, len(vocab))
    tok = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    return directory
