"""The offline fine-tuning demo's data set: is a sentence from CPython's documentation (label 1,
``builtin:python_docs``) or from Wikipedia (label 0, wikitext-2)? Real text already on the machine.

    python -m tacl_jax.finetune.demo_data --wikitext=/work/shared/data/wikitext-2 --out=/tmp/ft_demo_data

writes ``train.jsonl`` / ``validation.jsonl`` (``{"sentence": ..., "label": 0|1}``) and
``stats.json``. Deterministic (sorted sources, a seeded shuffle). Made hard on purpose, so that
accuracy does not saturate and two implementations can differ measurably: the formatting cues
are removed from both sides (lower case; wikitext's ``@-@``/`` , `` tokenisation undone; sentences
with code characters, digits, ``<unk>``, headings or brackets dropped) and the two classes get the
same sentence-length distribution (equal counts per word-count bucket), and sentences holding one
of each class's most revealing words (highest log-odds: 'function', 'argument', ... / 'century',
'army', ...) are dropped. What is left is the rest of the vocabulary and the style.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from typing import Iterable, Sequence

import numpy as np

from tacl_jax.data import preprocess

MIN_WORDS, MAX_WORDS = 8, 30
# Characters that give a sentence away at a glance (code, markup, numbers, wikitext artefacts).
_GIVEAWAY = re.compile(r"[0-9_=<>`*()\[\]{}|\\/#@~^$%&\"';:]|\.\w|\w\.\w")


def _detok_wikitext(line: str) -> str:
    """wikitext-2's tokenisation undone: ``a @-@ b`` -> ``a-b``, `` , `` -> ``, `` etc."""
    line = re.sub(r" @(.)@ ", r"\1", line)
    line = re.sub(r" ([.,;:!?)])", r"\1", line)
    line = re.sub(r"([(]) ", r"\1", line)
    return re.sub(r"\s+", " ", line).strip()


def _keep(sentence: str) -> bool:
    n = len(sentence.split())
    return MIN_WORDS <= n <= MAX_WORDS and not _GIVEAWAY.search(sentence) and sentence[-1:] in ".?!"


def _normalise(sentence: str) -> str:
    return sentence.lower()


def wikitext_sentences(folder: str, files: Sequence[str] = ("valid.txt", "test.txt")) -> list[str]:
    out = []
    for name in files:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("="):
                    continue
                out.extend(preprocess.split_sentences(_detok_wikitext(line)))
    return out


def python_doc_sentences() -> list[str]:
    from tacl_jax.data import python_docs  # pylint: disable=import-outside-toplevel
    return [s for doc in python_docs.documents() for line in doc for s in preprocess.split_sentences(line)]


def revealing_words(classes: Sequence[Sequence[str]], top: int) -> set[str]:
    """The ``top`` words of each class with the highest smoothed log-odds of that class: the
    words that alone give a sentence's class away (e.g. 'function', 'argument' / 'century')."""
    counts = [collections.Counter(w for s in sents for w in set(re.findall(r"[a-z]+", s))) for sents in classes]
    totals = [max(1, len(sents)) for sents in classes]
    vocab = set(counts[0]) | set(counts[1])
    out = set()
    for a, b in ((0, 1), (1, 0)):
        score = {w: np.log((counts[a][w] + 1) / totals[a]) - np.log((counts[b][w] + 1) / totals[b]) for w in vocab}
        out.update(sorted(vocab, key=lambda w: (-score[w], w))[:top])
    return out


def build(positives: Iterable[str], negatives: Iterable[str], seed: int = 0,
          validation_fraction: float = 0.2, drop_top_words: int = 0) -> tuple[list[dict], list[dict], dict]:
    """Filtered, de-duplicated, length-matched rows of both classes, shuffled and split:
    ``(train, validation, stats)``. Rows: ``{'sentence', 'label'}`` (1 = ``positives``).
    ``drop_top_words``: sentences holding one of each class's most revealing words are dropped."""
    rng = np.random.default_rng(seed)
    kept = []
    for sents in (negatives, positives):
        seen = []
        for s in sents:
            s = _normalise(s.strip())
            if _keep(s):
                seen.append(s)
        kept.append(list(dict.fromkeys(seen)))
    banned = revealing_words(kept, drop_top_words) if drop_top_words else set()
    pools = {}
    for label in (0, 1):
        by_len = collections.defaultdict(list)
        for s in kept[label]:
            if not banned.intersection(re.findall(r"[a-z]+", s)):
                by_len[len(s.split())].append(s)
        pools[label] = by_len
    rows = []
    for n in range(MIN_WORDS, MAX_WORDS + 1):   # equal counts per length: length says nothing
        k = min(len(pools[0][n]), len(pools[1][n]))
        for label in (0, 1):
            pick = rng.permutation(len(pools[label][n]))[:k]
            rows.extend({"sentence": pools[label][n][i], "label": label} for i in sorted(pick))
    rows = [rows[i] for i in rng.permutation(len(rows))]
    n_val = int(round(len(rows) * validation_fraction))
    stats = {"rows": len(rows), "train": len(rows) - n_val, "validation": n_val,
             "positives": sum(r["label"] for r in rows), "seed": seed, "dropped_words": len(banned)}
    return rows[n_val:], rows[:n_val], stats


def write_jsonl(rows: Sequence[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wikitext", required=True, help="folder with wikitext-2's valid.txt and test.txt")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_rows", type=int, default=0, help="rows in all (train + validation), 0 = all")
    p.add_argument("--drop_top_words", type=int, default=20,
                   help="drop sentences with one of each class's N most revealing words (harder task)")
    a = p.parse_args(argv)
    train, val, stats = build(python_doc_sentences(), wikitext_sentences(a.wikitext), a.seed,
                              drop_top_words=a.drop_top_words)
    if a.max_rows:
        n_val = int(round(a.max_rows * 0.2))
        train, val = train[:a.max_rows - n_val], val[:n_val]
        stats.update(train=len(train), validation=len(val))
    os.makedirs(a.out, exist_ok=True)
    write_jsonl(train, os.path.join(a.out, "train.jsonl"))
    write_jsonl(val, os.path.join(a.out, "validation.jsonl"))
    with open(os.path.join(a.out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    main()
