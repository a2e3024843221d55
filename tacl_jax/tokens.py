"""Special-token ids: read from the run's tokenizer, or BERT's defaults when there is none."""

from __future__ import annotations

import json
import os

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def default_special_ids(vocab_size: int) -> dict[str, int]:
    """bert-base-uncased's ids for BERT-sized vocabularies, small ids for toy ones (tests)."""
    if vocab_size >= 1000:
        return dict(pad=0, unk=100, cls=101, sep=102, mask=103)
    return dict(pad=0, unk=1, cls=2, sep=3, mask=4)


def special_ids_from_tokenizer(path: str) -> dict[str, int]:
    """Ids of [PAD] [UNK] [CLS] [SEP] [MASK] in the WordPiece vocabulary of ``path`` (a folder
    with ``vocab.txt`` or ``tokenizer.json``)."""
    vocab_txt, tok_json = os.path.join(path, "vocab.txt"), os.path.join(path, "tokenizer.json")
    if os.path.isfile(vocab_txt):
        with open(vocab_txt, encoding="utf-8") as f:
            vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    elif os.path.isfile(tok_json):
        with open(tok_json, encoding="utf-8") as f:
            vocab = json.load(f)["model"]["vocab"]
    else:
        raise FileNotFoundError(f"no vocab.txt or tokenizer.json in {path}: the run's tokenizer lives "
                                "beside the init checkpoint (set config.init.tokenizer_path)")
    missing = [t for t in SPECIAL_TOKENS.values() if t not in vocab]
    if missing:
        raise ValueError(f"the tokenizer in {path} lacks {missing}: it is not a BERT WordPiece vocabulary")
    return {k: int(vocab[t]) for k, t in SPECIAL_TOKENS.items()}


def vocab_size_of_tokenizer(path: str) -> int | None:
    vocab_txt = os.path.join(path, "vocab.txt")
    if os.path.isfile(vocab_txt):
        with open(vocab_txt, encoding="utf-8") as f:
            return sum(1 for _ in f)
    tok_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tok_json):
        with open(tok_json, encoding="utf-8") as f:
            return len(json.load(f)["model"]["vocab"])
    return None
