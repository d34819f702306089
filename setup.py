"""megatron_tawpipe: weight-passing pipeline parallelism (TawPipe, WeiPipe) for Megatron-Core."""

import os
import runpy

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# The supported megatron-core and torch releases, stated once in compat/versions.py; run on its own (not
# imported with the package: this runs before torch and megatron-core are installed).
VERSIONS = runpy.run_path(os.path.join(HERE, "megatron_tawpipe", "compat", "versions.py"))

setup(
    name="megatron_tawpipe",
    version="0.1.0",
    description="TawPipe and WeiPipe weight-passing pipeline schedules for Megatron-Core training",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tawpipe", "megatron_tawpipe.*"]),
    py_modules=["pretrain_llama"],
    # Megatron-LM's flag table pretrain_llama.py answers from, and the recorded parsers it is made of.
    package_data={"megatron_tawpipe.compat": ["flag_data/*.tsv"]},
    # torch is not pinned here on purpose: install the build you want first
    # (the CPU build with `pip install torch==2.13.0` on CPU machines, a CUDA
    # build on GPU clusters); any torch in the supported range satisfies this requirement.
    install_requires=[
        VERSIONS["requirement"]("torch"),           # torch>=2.6
        VERSIONS["requirement"]("megatron-core"),   # megatron-core>=0.16,<0.20 (CI: 0.16.1; 0.17.0, 0.19.2)
        "sentencepiece>=0.2",
        "numpy",
        # megatron-core's partial data parallelism (--num-distributed-optimizer-instances) builds its
        # hierarchical process groups with einops, an optional dependency of the megatron-core wheel.
        "einops",
        # megatron-core's torch_dist checkpoint writer (--ckpt-format torch_dist, the default) needs it.
        "psutil",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "apex"],
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard"],
        # Megatron-LM's HuggingFaceTokenizer / TikTokenizer (through megatron-core) and GPT2BPETokenizer.
        "tokenizers": ["transformers", "tiktoken", "tokenizers"],
        "wandb": ["wandb"],
        # tools/hf_checkpoint.py: Hugging Face weights in and out (safetensors files; transformers is not needed,
        # the tests use it to check the conversion). Neither package requires torch: the installed one is kept.
        "hf": ["safetensors"],
        "test": ["pytest>=7", "import-linter>=2.1", "matplotlib", "tensorboard", "transformers", "tiktoken", "tokenizers",
                 "wandb", "safetensors"],
    },
)
