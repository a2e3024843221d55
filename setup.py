"""tacl_jax: TaCL (token-aware contrastive pre-training), COCO-LM and MLM for BERT in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name="tacl_jax",
    version="0.1.0",
    description="TPU-native TaCL / COCO-LM / MLM pre-training of BERT in JAX and Flax",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tacl_jax", "tacl_jax.*"]),
    # The allocator shim's source: tacl_jax.hostenv compiles it at first use (see its module doc).
    package_data={"tacl_jax": ["bigalloc.c"]},
    python_requires=">=3.11",  # what current jax and flax require
    install_requires=[
        "jax>=0.7",
        "flax>=0.11",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "ml-collections>=1.0",
        "absl-py",
        "numpy",
        "safetensors>=0.4",
        "transformers>=4.40",
        "tokenizers>=0.19",
        "grain>=0.2.10",
        "tensorflow-datasets>=4.9.7",
        "array-record>=0.5",
        "tqdm",
        "tensorboardX",
        "matplotlib",  # the analysis plots (tacl_jax.analyze)
    ],
    extras_require={
        # torch only to check that transformers loads our exports; 2.13.0 is the CPU build that
        # pip finds locally on our CI machines (a bare `torch` pulls a multi-GB CUDA build).
        "test": ["pytest>=8", "torch==2.13.0"],
        "tpu": ["jax[tpu]"],
        "gpu": ["jax[cuda12]"],
    },
)
