"""Fine-tune a BERT on a GLUE task (or your own classification/regression/QA data).

    python -m tacl_jax.finetune --config=configs/finetune.py --workdir=/tmp/ft_sst2 \
        --config.init.path=bert-base-uncased --config.task=sst2 \
        --config.data.train_file=sst2/train.jsonl --config.data.validation_file=sst2/validation.jsonl

``init.path``: a Hugging Face folder or Hub id (from the cache when offline) or a tacl_jax
pre-training workdir (its ``export/final``). ``task``: cola, sst2, mrpc, qqp, stsb, mnli, qnli,
rte, wnli (columns/labels/metrics from ``tacl_jax.finetune.tasks.GLUE``), or 'classification',
'regression', 'qa' with the columns in ``data.*``. Data: local .csv/.tsv/.jsonl files, or
``--config.data.hf_dataset=glue`` to read the ``datasets`` cache (optional package). The numbers
are transformers' run_glue.py defaults (lr 2e-5, batch 32, length 128, 3 epochs, no warm-up, no
weight decay); every key with its default: ``tacl_jax/finetune/config.py``.
"""

from tacl_jax.finetune.config import default_config


def get_config():
    c = default_config()
    c.init.path = "bert-base-uncased"
    c.task = "sst2"
    c.eval_every = 0
    c.checkpoint.every = 1000
    return c
