"""A tiny TaCL run on synthetic data: tests and a CPU smoke test.

    python -m tacl_jax.main --config=configs/tiny.py --workdir=/tmp/tacl_tiny

Any CPU, ~1 minute. Random ids, random teacher: the losses fall (the MLM learns unigram
statistics, the student learns to match the teacher) but nothing here is a language model.
"""

from tacl_jax.config import default_config


def get_config():
    c = default_config()
    c.init.from_scratch = True
    c.init.scratch.update(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64)
    c.max_len = 32
    c.global_batch_size = 8
    c.num_train_steps = 100
    c.log_every = 10
    c.optim.learning_rate = 1e-3
    c.model.dtype = "float32"
    return c
