"""Fine-tuning a BERT (a Hugging Face folder/Hub id, or a tacl_jax pre-training run) on sentence
(pair) classification/regression (GLUE) and SQuAD-style extractive QA.

    python -m tacl_jax.finetune --config=configs/finetune.py --workdir=DIR [--config.x.y=v]

Modules: ``config`` (every key), ``tasks`` (the GLUE table), ``data`` (CSV/TSV/JSONL and the
``datasets`` cache; tokenization; batch order), ``heads`` (Bert/Roberta/ElectraForSequenceClassification
and ForQuestionAnswering in Flax), ``squad`` (windows, span decoding, EM/F1), ``metrics``
(numpy GLUE metrics), ``train`` (the run), ``export`` (the fine-tuned model as a transformers folder), ``demo_data`` (the offline demo's data set).
"""
