"""Input data for TaCL pre-training: sources, tokenization, packing, prepared datasets, batches.

Entry points: :func:`make_train_iterator` and :func:`make_eval_batches` (``config.data`` from
:func:`tacl_jax.data.config.default_config`), and ``python -m tacl_jax.data.prepare``.
"""

from tacl_jax.data.config import default_config
from tacl_jax.data.pipeline import TrainIterator
from tacl_jax.data.pipeline import make_eval_batches
from tacl_jax.data.pipeline import make_train_iterator
from tacl_jax.data.tokenization import default_tokenizer_dir

__all__ = ["TrainIterator", "default_config", "default_tokenizer_dir", "make_eval_batches",
           "make_train_iterator"]
