"""The ``config.data`` block: where text comes from and how it becomes packed rows.

A run's config does ``config.data = data_config.default_config()`` and overrides fields, e.g.
``--config.data.source=text:/corpus/*.txt.gz``. The run-level ``max_len``, ``global_batch_size`` and
``seed`` live outside this block and are passed to :func:`tacl_jax.data.make_train_iterator`.
"""

from __future__ import annotations

import ml_collections

from tacl_jax.errors import ConfigError

PACKING_MODES = ("full_sentences", "nsp_pairs", "contiguous")
TEXT_DOC_SEPARATORS = ("blank_line", "line")


def default_config() -> ml_collections.ConfigDict:
    """Every data key, with its default. See the field comments for what each one does."""
    c = ml_collections.ConfigDict()
    # Where the text comes from, one of:
    #   'synthetic'                      random ids shaped like packed rows (benchmarks only; not text)
    #   'builtin:python_docs'            English text shipped inside CPython (offline demo corpus)
    #   'text:/a/*.txt,/b/part-*.jsonl.gz'  local files or globs, comma-separated; .gz read
    #                                    transparently; .jsonl(.gz) takes each record's `text_field`
    #   'tfds:wikipedia/20230601.en'     a TFDS dataset read with tfds.data_source (ArrayRecord)
    #   'prepared:/path/from/prepare'    the output of `python -m tacl_jax.data.prepare`
    # Everything but 'synthetic' and 'prepared:' is tokenized and packed when training starts
    # (fine up to ~1e8 tokens); for larger corpora run `prepare` once.
    c.source = "synthetic"
    c.data_dir = ""  # TFDS data_dir for 'tfds:' sources (local or gs://); '' = TFDS default.
    c.text_field = "text"  # The text field of .jsonl records and of 'tfds:' examples.
    # Plain-text files: 'blank_line' = documents are separated by blank lines (BERT's format,
    # wikitext paragraphs); 'line' = one document per line.
    c.text_doc_separator = "blank_line"
    # 'full_sentences' (default, RoBERTa): whole sentences packed into [CLS] ... [SEP] rows of at
    # most max_len, crossing documents with an extra [SEP] between them; every corpus token lands in
    # exactly one row. 'nsp_pairs' (BERT, the original TaCL): [CLS] A [SEP] B [SEP] with B the actual
    # continuation or, with probability 1/2, a span of another document (next_sentence_label=1).
    # 'contiguous' (Hugging Face run_mlm's group_texts): the text cut into full rows wherever a row
    # fills, mid-sentence too, documents joined by one [SEP]; no padding (full_sentences pads ~25% at L 64).
    c.packing = "full_sentences"
    # Probability that a row targets a random shorter length in [2, max_len - 2] (BERT: 0.1);
    # 0 packs every row as full as whole sentences allow.
    c.short_seq_prob = 0.1
    # Fraction of documents held out for eval (chosen by document index, never packed into train).
    c.eval_fraction = 0.01
    # Documents are dealt round-robin to this many shards, packed independently; `prepare` runs one
    # worker per shard. Part of the dataset's identity: the same value gives the same rows.
    c.num_shards = 8
    # Input pipeline (grain): worker processes (0 = read in the training process), read threads,
    # and the number of batches prefetched ahead of the step.
    c.worker_count = 0
    c.read_threads = 2
    c.prefetch = 4
    # Added to the run's seed for the shuffle, to reshuffle data without changing model init.
    c.shuffle_seed_offset = 0
    # 'synthetic' only: the smallest non-special id (-1 = 999 when vocab_size > 2000, else 5).
    c.first_regular_id = -1
    return c


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the key and the fix for any out-of-range data setting."""
    if config.packing not in PACKING_MODES:
        raise ConfigError(f"config.data.packing={config.packing!r}: use one of {PACKING_MODES}")
    if config.text_doc_separator not in TEXT_DOC_SEPARATORS:
        raise ConfigError(f"config.data.text_doc_separator={config.text_doc_separator!r}: use one "
                         f"of {TEXT_DOC_SEPARATORS}")
    if not 0.0 <= config.short_seq_prob <= 1.0:
        raise ConfigError(f"config.data.short_seq_prob={config.short_seq_prob} must be in [0, 1]")
    if not 0.0 <= config.eval_fraction < 1.0:
        raise ConfigError(f"config.data.eval_fraction={config.eval_fraction} must be in [0, 1)")
    if config.num_shards < 1:
        raise ConfigError(f"config.data.num_shards={config.num_shards} must be >= 1")
    for key in ("worker_count", "read_threads", "prefetch"):
        if config[key] < 0:
            raise ConfigError(f"config.data.{key}={config[key]} must be >= 0")
