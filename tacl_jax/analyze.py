"""The TaCL paper's isotropy analysis: layer-wise self-similarity and a cosine heat map.

    python -m tacl_jax.analyze --hf=/path/init_bert --hf=/run/export/latest \
        --labels=BERT,TaCL --corpus=/data/wikitext-2/test.txt --out=/tmp/analysis
    python -m tacl_jax.analyze --hf=/path/init_bert --workdir=/run --labels=init,run \
        --corpus=builtin:python_docs --out=/run/analysis      # the run's export/{latest,final}

Definition (``docs/method.md`` §1, "Analysis"). Every sentence is fed alone as
``[CLS] text [SEP]`` (no padding seen: padded positions are masked out of the attention and out of
the statistic). For each layer ``l`` (0 = the embeddings output, 1..N = the encoder layers) the
token states are L2-normalised and the cosines of all pairs ``i < j`` (``[CLS]``/``[SEP]``
included) are summed. The layer's score is a micro-average over the corpus::

    s_l = Σ_sentences Σ_{i<j} cos(h_i^l, h_j^l) / Σ_sentences n(n-1)/2

Lower is more isotropic; TaCL's claim is that it lowers ``s_l``, most at the top layers.

Outputs in ``--out``: ``self_similarity.json`` (per model: the score per layer, plus the corpus
counts), ``self_similarity.png`` (score vs layer, one line per model) and ``cosine_heatmap.png``
(the last-layer cosine matrix of one sentence, one panel per model, side by side).

Corpus (``--corpus``): a text file or glob (``text:`` is optional), ``builtin:python_docs``, or any
document source of ``tacl_jax.data``; lines are split into sentences by ``tacl_jax.data``'s
splitter; wikitext headings (``= Title =``) and sentences of fewer than ``--min_words`` words are
skipped; ``--max_sentences`` are drawn at random (seed ``--seed``) in corpus order.
``--split=heldout`` keeps only the documents the training pipeline holds out
(``--eval_fraction``, the same rule as ``config.data.eval_fraction``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

# Sentence batches are padded to a multiple of this (fewer compilations, little padding).
_LENGTH_BUCKET = 16


# ----------------------------------------------------------------------------- the statistic

def unit(h: jax.Array) -> jax.Array:
    """``h [..., H]`` as f32, L2-normalised along the last axis."""
    h = h.astype(jnp.float32)
    return h * jax.lax.rsqrt(jnp.maximum(jnp.sum(h * h, axis=-1, keepdims=True), 1e-24))


def pair_cosine_sums(h: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``h [B, L, H]`` token states, ``m [B, L]`` 1 on the tokens to pair -> ``(Σ cos, pair count)``
    over the pairs ``i < j`` of the same row with both ends in ``m`` (scalars, f32)."""
    m = m.astype(jnp.float32)
    length = h.shape[1]
    upper = jnp.triu(jnp.ones((length, length), jnp.float32), k=1)               # i < j
    pair_w = m[:, :, None] * m[:, None, :] * upper                               # [B, L, L]
    h = unit(h)
    cos = jnp.einsum("bid,bjd->bij", h, h, precision=jax.lax.Precision.HIGHEST)
    n = m.sum(-1)
    return jnp.sum(cos * pair_w), jnp.sum(n * (n - 1.0) / 2.0)


@functools.lru_cache(maxsize=16)
def _sums_fn(model):
    """Jitted ``(params, ids [B, L], mask [B, L]) -> (sums [N+1], counts [N+1])`` for ``model``."""

    def fn(params, input_ids, attention_mask):
        out = model.apply({"params": params}, input_ids, attention_mask, jnp.zeros_like(input_ids),
                          deterministic=True, output_hidden_states=True, heads=False)
        sums, counts = zip(*(pair_cosine_sums(h, attention_mask) for h in out.hidden_states))
        return jnp.stack(sums), jnp.stack(counts)

    return jax.jit(fn)


def self_similarity_sums(model, params, input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """Pair-cosine sums and pair counts per layer for one batch of sentences.

    ``input_ids``, ``attention_mask``: ``[B, L]``, each row ``[CLS] text [SEP]`` then padding
    (``attention_mask`` 0). Returns float64 ``(sums, counts)``, each ``[num_layers + 1]``
    (index 0 = the embeddings output). Add them over batches and divide at the end for the
    corpus micro-average.
    """
    sums, counts = _sums_fn(model)(params, jnp.asarray(input_ids, jnp.int32),
                                   jnp.asarray(attention_mask, jnp.int32))
    return np.asarray(sums, np.float64), np.asarray(counts, np.float64)


def self_similarity(model, params, input_ids, attention_mask) -> np.ndarray:
    """Layer-wise self-similarity ``[num_layers + 1]`` of one batch (micro-average over its
    sentences' pairs); see :func:`self_similarity_sums` for shapes."""
    sums, counts = self_similarity_sums(model, params, input_ids, attention_mask)
    return sums / np.maximum(counts, 1.0)


@functools.lru_cache(maxsize=16)
def _last_layer_fn(model):
    def fn(params, input_ids):
        out = model.apply({"params": params}, input_ids, jnp.ones_like(input_ids), jnp.zeros_like(input_ids),
                          deterministic=True, heads=False)
        h = unit(out.last_hidden_state[0])
        return jnp.einsum("id,jd->ij", h, h, precision=jax.lax.Precision.HIGHEST)

    return jax.jit(fn)


def cosine_matrix(model, params, input_ids: Sequence[int]) -> np.ndarray:
    """Last-layer token cosine matrix ``[n, n]`` of one sentence (``[CLS] ... [SEP]`` ids)."""
    return np.asarray(_last_layer_fn(model)(params, jnp.asarray(input_ids, jnp.int32)[None]))


# ----------------------------------------------------------------------------- sentences

class NoSentences(ValueError):
    """The corpus (or split) has no sentence to analyse; the message says why."""


def corpus_sentences(corpus: str, *, max_sentences: int = 2000, min_words: int = 3, seed: int = 0,
                     split: str = "all", eval_fraction: float = 0.01, scan_limit: int = 0) -> list[str]:
    """Sentences of ``corpus`` (see the module doc), at most ``max_sentences`` (0 = all), drawn at
    random with ``seed`` and returned in corpus order."""
    from tacl_jax.data import config as data_config_lib
    from tacl_jax.data import sources

    kind = corpus.partition(":")[0]
    if kind not in sources.SOURCE_KINDS:
        corpus = "text:" + corpus
    dc = data_config_lib.default_config()
    dc.source = corpus
    return source_sentences(dc, max_sentences=max_sentences, min_words=min_words, seed=seed, split=split,
                            eval_fraction=eval_fraction, scan_limit=scan_limit)


def source_sentences(data_config, *, max_sentences: int = 2000, min_words: int = 3, seed: int = 0,
                     split: str = "all", eval_fraction: float = 0.01, scan_limit: int = 0) -> list[str]:
    """:func:`corpus_sentences` of the document source a ``config.data`` names (text, tfds or
    builtin, with its ``text_doc_separator``/``text_field``/``data_dir``). ``scan_limit`` > 0 stops
    reading the corpus once that many candidate sentences are found (large corpora); the sample is
    then drawn from those. Raises :class:`NoSentences` when there is none."""
    from tacl_jax.data import preprocess, sources

    if split not in ("all", "heldout"):
        raise ValueError(f"split={split!r}: use 'all' or 'heldout'")
    src = sources.open_source(data_config)
    out = []
    for doc_index, lines in src.documents():
        if split == "heldout" and not preprocess.is_eval_document(doc_index, eval_fraction):
            continue
        for line in lines:
            if line.startswith("=") and line.endswith("="):   # wikitext headings
                continue
            out.extend(s for s in preprocess.split_sentences(line) if len(s.split()) >= min_words)
        if scan_limit and len(out) >= scan_limit:
            break
    if not out:
        raise NoSentences(f"{data_config.source!r} ({split}) has no sentence of at least {min_words} words")
    if max_sentences and len(out) > max_sentences:
        keep = np.sort(np.random.default_rng(seed).choice(len(out), max_sentences, replace=False))
        out = [out[i] for i in keep]
    return out


def heldout_sentences(data_config, *, max_sentences: int, min_words: int = 3, seed: int = 0,
                      scan_limit: int = 0) -> tuple[list[str], str]:
    """Sentences of a training run's held-out split (``config.data``): the documents
    ``config.data.eval_fraction`` holds out, read again as text. For a ``prepared:`` source, the
    text source its ``metadata.json`` records. Returns ``(sentences, source description)``; raises
    :class:`NoSentences` saying why when the run has no held-out text (synthetic ids,
    ``eval_fraction=0``, a prepared dataset whose text is not readable here)."""
    from tacl_jax.data import sources

    kind, arg = sources.parse_source(data_config.source)
    dc = data_config
    if kind == "synthetic":
        raise NoSentences("config.data.source='synthetic' is random ids, not text")
    if kind == "prepared":
        from tacl_jax.data import tfds_builder

        try:
            meta = tfds_builder.PreparedRows(arg, "validation").metadata
        except ValueError as e:
            raise NoSentences(str(e)) from e
        if not meta.get("source"):
            raise NoSentences(f"the prepared dataset {arg} does not record its text source")
        dc = data_config.copy_and_resolve_references()
        with dc.unlocked():
            dc.source = meta["source"]
            dc.eval_fraction = meta.get("eval_fraction", dc.eval_fraction)
            dc.text_doc_separator = meta.get("text_doc_separator", dc.text_doc_separator)
            dc.text_field = meta.get("text_field", dc.text_field)
    if dc.eval_fraction <= 0:
        raise NoSentences("config.data.eval_fraction=0: the run holds out no documents")
    try:
        sentences = source_sentences(dc, max_sentences=max_sentences, min_words=min_words, seed=seed,
                                     split="heldout", eval_fraction=dc.eval_fraction, scan_limit=scan_limit)
    except (FileNotFoundError, ValueError) as e:
        if isinstance(e, NoSentences):
            raise
        raise NoSentences(f"the held-out text of {dc.source!r} is not readable here ({e})") from e
    return sentences, dc.source


@dataclasses.dataclass
class Encoded:
    ids: list[np.ndarray]          # per sentence: [CLS] ... [SEP]
    tokens: list[list[str]]
    truncated: int


def encode_sentences(sentences: Sequence[str], tokenizer_dir: str, max_len: int = 128) -> Encoded:
    """Each sentence as ``[CLS] text [SEP]`` ids with the tokenizer of ``tokenizer_dir``,
    truncated to ``max_len`` ids in all."""
    from tacl_jax.data import tokenization

    tok = tokenization.load_tokenizer(tokenizer_dir)
    special = tokenization.tokenizer_special_ids(tok, tokenizer_dir)
    ids, toks, truncated = [], [], 0
    for enc in tok.encode_batch(list(sentences), add_special_tokens=False):
        body = list(enc.ids)
        if len(body) > max_len - 2:
            body, truncated = body[:max_len - 2], truncated + 1
        row = [special["cls"]] + body + [special["sep"]]
        ids.append(np.asarray(row, np.int32))
        toks.append([tok.id_to_token(i) for i in row])
    return Encoded(ids=ids, tokens=toks, truncated=truncated)


def _batches(ids: list[np.ndarray], batch_size: int, pad_id: int = 0):
    """Sentences sorted by length, padded per batch to a multiple of ``_LENGTH_BUCKET`` with
    ``pad_id`` (the model's: RoBERTa's position ids count every id that is not its pad)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch_size):
        chunk = [ids[i] for i in order[start:start + batch_size]]
        length = -(-max(len(r) for r in chunk) // _LENGTH_BUCKET) * _LENGTH_BUCKET
        rows = len(chunk) if len(chunk) == batch_size else batch_size   # constant batch shape
        x = np.full((rows, length), pad_id, np.int32)
        m = np.zeros((rows, length), np.int32)
        for r, row in enumerate(chunk):
            x[r, :len(row)] = row
            m[r, :len(row)] = 1
        yield x, m


def corpus_self_similarity(model, params, ids: list[np.ndarray], batch_size: int = 32) -> dict[str, Any]:
    """Micro-averaged self-similarity of a list of ``[CLS] ... [SEP]`` id arrays."""
    sums = counts = 0.0
    for x, m in _batches(ids, batch_size, model.config.pad_token_id):
        s, c = self_similarity_sums(model, params, x, m)
        sums, counts = sums + s, counts + c
    scores = sums / np.maximum(counts, 1.0)
    return dict(self_similarity=[float(v) for v in scores], pair_cosine_sums=[float(v) for v in sums],
                pair_count=float(counts[0]), last_layer=float(scores[-1]))


# ----------------------------------------------------------------------------- models and plots

@dataclasses.dataclass
class Entry:
    """One model to analyse: a label, the module and its params, and its tokenizer folder."""
    label: str
    model: Any
    params: Any
    tokenizer_dir: str
    path: str = ""


def load_entry(path: str, label: str | None = None) -> Entry:
    """An HF BERT folder or Hub id (read through the Hugging Face cache) as an encoder-only float32
    model for the analysis; the label defaults to the folder's or repo's name."""
    from tacl_jax import hf
    from tacl_jax.data import tokenization

    folder = hf.resolve(path)
    model, params = hf.load(folder, dtype="float32", with_mlm_head=False, with_pooler=False, with_nsp_head=False)
    tok_dir = folder
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "vocab.txt")):
        tok_dir = tokenization.default_tokenizer_dir()
        log.warning("%s has no tokenizer: using the default uncased BERT vocabulary in %s", path, tok_dir)
    return Entry(label=label or os.path.basename(os.path.normpath(path)), model=model,
                 params=jax.tree.map(jnp.asarray, params), tokenizer_dir=tok_dir, path=path)


def float32_entry(entry: Entry) -> Entry:
    """The same weights computed in float32 (the analysis is not a speed path)."""
    cfg = entry.model.config
    if cfg.dtype == "float32":
        return entry
    return dataclasses.replace(entry, model=type(entry.model)(cfg.replace(dtype="float32")))


def _pick_heatmap_sentence(sentences: Sequence[str], encoded: Encoded, lo: int = 12, hi: int = 24) -> int:
    for i, row in enumerate(encoded.ids):
        if lo <= len(row) <= hi:
            return i
    return int(np.argmin([abs(len(r) - hi) for r in encoded.ids]))


def plot_self_similarity(results: Sequence[dict], path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for r in results:
        ys = r["self_similarity"]
        ax.plot(range(len(ys)), ys, marker="o", label=r["label"])
    n = max(len(r["self_similarity"]) for r in results)
    ax.set_xticks(range(n))
    ax.set_xticklabels(["emb"] + [str(i) for i in range(1, n)])
    ax.set_xlabel("layer (emb = embeddings output)")
    ax.set_ylabel("self-similarity (mean pair cosine)")
    ax.set_title(title or "Layer-wise self-similarity (lower = more isotropic)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_heatmaps(panels: Sequence[tuple[str, np.ndarray, list[str]]], path: str, sentence: str = "") -> None:
    """``panels``: ``(label, cosine matrix [n, n], tokens)`` side by side, one shared colour scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(panels)
    n = max(m.shape[0] for _, m, _ in panels)
    size = min(6.0, 2.0 + 0.22 * n)
    fig, axes = plt.subplots(1, k, figsize=(size * k + 1.2, size + 0.8), dpi=120, squeeze=False)
    vmin = min(-0.1, min(float(m.min()) for _, m, _ in panels))
    im = None
    for ax, (label, mat, tokens) in zip(axes[0], panels):
        im = ax.imshow(mat, vmin=vmin, vmax=1.0, cmap="viridis")
        ax.set_title(f"{label}\nmean off-diagonal cos {_offdiag_mean(mat):.3f}", fontsize=9)
        if len(tokens) <= 40:
            ax.set_xticks(range(len(tokens)))
            ax.set_xticklabels(tokens, rotation=90, fontsize=6)
            ax.set_yticks(range(len(tokens)))
            ax.set_yticklabels(tokens, fontsize=6)
    fig.colorbar(im, ax=list(axes[0]), shrink=0.8)
    if sentence:
        fig.suptitle(f"last-layer token cosines: \"{sentence[:90]}{'…' if len(sentence) > 90 else ''}\"",
                     fontsize=8)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _offdiag_mean(mat: np.ndarray) -> float:
    n = mat.shape[0]
    iu = np.triu_indices(n, k=1)
    return float(mat[iu].mean()) if n > 1 else float("nan")


def run_analysis(entries: Sequence[Entry], sentences: Sequence[str], out_dir: str | None, *,
                 max_len: int = 128, batch_size: int = 32, heatmap_sentence: str | None = None,
                 corpus: str = "") -> dict[str, Any]:
    """Self-similarity of every model on ``sentences``; writes JSON + PNGs to ``out_dir`` (if
    given). Returns the JSON object."""
    if not entries:
        raise ValueError("nothing to analyse: give at least one model")
    results, panels = [], []
    hm_text = heatmap_sentence
    for e in entries:
        e = float32_entry(e)
        enc = encode_sentences(sentences, e.tokenizer_dir, max_len)
        r = dict(label=e.label, path=e.path, num_layers=e.model.config.num_hidden_layers,
                 **corpus_self_similarity(e.model, e.params, enc.ids, batch_size))
        r["truncated_sentences"] = enc.truncated
        log.info("%s: self-similarity per layer %s", e.label, " ".join(f"{v:.3f}" for v in r["self_similarity"]))
        results.append(r)
        if hm_text is None:
            hm_text = sentences[_pick_heatmap_sentence(sentences, enc)]
        one = encode_sentences([hm_text], e.tokenizer_dir, max_len)
        panels.append((e.label, cosine_matrix(e.model, e.params, one.ids[0]), one.tokens[0]))
    report = dict(corpus=corpus, num_sentences=len(sentences), max_len=max_len,
                  definition="per layer: sum over sentences of sum_{i<j} cos(h_i, h_j) / sum of n(n-1)/2; "
                             "each sentence alone as [CLS] text [SEP]; layer 0 = embeddings output",
                  models=results, heatmap=dict(sentence=hm_text, mean_offdiag={
                      label: _offdiag_mean(m) for label, m, _ in panels}))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "self_similarity.json"), "w") as f:
            json.dump(report, f, indent=1)
        plot_self_similarity(results, os.path.join(out_dir, "self_similarity.png"))
        plot_heatmaps(panels, os.path.join(out_dir, "cosine_heatmap.png"), hm_text)
        report["files"] = {k: os.path.join(out_dir, k) for k in
                           ("self_similarity.json", "self_similarity.png", "cosine_heatmap.png")}
    return report


def workdir_export(workdir: str) -> str:
    """The HF export of a training run's workdir: ``export/latest`` if there is one, else
    ``export/final``, else the ``export/step_N`` with the largest N."""
    base = os.path.join(workdir, "export")
    for name in ("latest", "final"):
        if os.path.isdir(os.path.join(base, name)):
            return os.path.join(base, name)
    steps = [d for d in (os.listdir(base) if os.path.isdir(base) else []) if d.startswith("step_")
             and d[5:].isdigit()]
    if steps:
        return os.path.join(base, max(steps, key=lambda d: int(d[5:])))
    raise FileNotFoundError(f"{workdir} has no Hugging Face export (export/latest, export/final or "
                            "export/step_N); train with config.export_at_end=True or give --hf=DIR")


def analyze(hf_dirs: Sequence[str], corpus: str, out_dir: str | None, *, labels: Sequence[str] | None = None,
            max_sentences: int = 2000, max_len: int = 128, batch_size: int = 32, min_words: int = 3,
            seed: int = 0, split: str = "all", eval_fraction: float = 0.01,
            heatmap_sentence: str | None = None) -> dict[str, Any]:
    """Load every HF folder in ``hf_dirs``, analyse them on ``corpus``, write to ``out_dir``."""
    labels = list(labels or [])
    if labels and len(labels) != len(hf_dirs):
        raise ValueError(f"{len(labels)} labels for {len(hf_dirs)} models")
    entries = [load_entry(p, labels[i] if labels else None) for i, p in enumerate(hf_dirs)]
    sentences = corpus_sentences(corpus, max_sentences=max_sentences, min_words=min_words, seed=seed,
                                 split=split, eval_fraction=eval_fraction)
    return run_analysis(entries, sentences, out_dir, max_len=max_len, batch_size=batch_size,
                        heatmap_sentence=heatmap_sentence, corpus=corpus)


# ----------------------------------------------------------------------------- command line

def parse_args(argv: Sequence[str] | None = None):
    import argparse

    p = argparse.ArgumentParser(prog="python -m tacl_jax.analyze", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", action="append", default=[], help="Hugging Face BERT folder (repeat for several models).")
    p.add_argument("--workdir", default=None,
                   help="A training run's workdir: analyses its export (latest, final or newest step_N).")
    p.add_argument("--labels", default="", help="Comma-separated labels, one per model (--hf order, then --workdir).")
    p.add_argument("--corpus", default="builtin:python_docs",
                   help="Text file/glob, 'text:...', or 'builtin:python_docs'.")
    p.add_argument("--out", required=True, help="Output folder for the JSON and the PNGs.")
    p.add_argument("--max_sentences", type=int, default=2000, help="Sentences drawn from the corpus (0 = all).")
    p.add_argument("--max_len", type=int, default=128, help="Ids per sentence incl. [CLS] and [SEP] (longer: cut).")
    p.add_argument("--batch_size", type=int, default=32, help="Sentences per forward pass.")
    p.add_argument("--min_words", type=int, default=3, help="Skip shorter sentences.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the sentence sample.")
    p.add_argument("--split", choices=("all", "heldout"), default="all",
                   help="'heldout' = only the documents training holds out (config.data.eval_fraction).")
    p.add_argument("--eval_fraction", type=float, default=0.01, help="The run's config.data.eval_fraction.")
    p.add_argument("--heatmap_sentence", default=None, help="Sentence of the heat map (default: one of 12-24 ids).")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line; prints one JSON line (the scores per model) and returns the report."""
    a = parse_args(argv)
    hf_dirs = list(a.hf)
    if a.workdir:
        hf_dirs.append(workdir_export(a.workdir))
    if not hf_dirs:
        raise SystemExit("give --hf=DIR (repeatable) and/or --workdir=DIR")
    labels = [s for s in a.labels.split(",") if s] or None
    report = analyze(hf_dirs, a.corpus, a.out, labels=labels, max_sentences=a.max_sentences, max_len=a.max_len,
                     batch_size=a.batch_size, min_words=a.min_words, seed=a.seed, split=a.split,
                     eval_fraction=a.eval_fraction, heatmap_sentence=a.heatmap_sentence)
    summary = {r["label"]: [round(v, 4) for v in r["self_similarity"]] for r in report["models"]}
    print(json.dumps(dict(self_similarity=summary, num_sentences=report["num_sentences"], out=a.out)))
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main()
