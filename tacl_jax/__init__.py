"""tacl_jax: TaCL, COCO-LM and MLM pre-training of BERT in JAX/Flax."""

__version__ = "0.1.0"
