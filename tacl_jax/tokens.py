"""Special-token ids of a run: from its tokenizer, or BERT's defaults when there is none."""

from __future__ import annotations


def default_special_ids(vocab_size: int) -> dict[str, int]:
    """bert-base-uncased's ids for BERT-sized vocabularies, small ids for toy ones (tests)."""
    if vocab_size >= 1000:
        return dict(pad=0, unk=100, cls=101, sep=102, mask=103)
    return dict(pad=0, unk=1, cls=2, sep=3, mask=4)


def run_special_ids(tokenizer_dir: str | None, vocab_size: int) -> dict[str, int]:
    """``pad cls sep mask unk`` ids: the tokenizer's (a folder or a Hub id; checked against the
    model's vocabulary), or the defaults for synthetic runs without a tokenizer."""
    if not tokenizer_dir:
        return default_special_ids(vocab_size)
    from tacl_jax.data import tokenization

    tokenizer_dir = tokenization.tokenizer_folder(tokenizer_dir)
    tok = tokenization.load_tokenizer(tokenizer_dir)
    ids = tokenization.bert_special_ids(tok, tokenizer_dir)
    tokenization.check_tokenizer(tok, vocab_size=vocab_size, special_ids=ids, tokenizer_dir=tokenizer_dir)
    return ids
