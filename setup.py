import re
from pathlib import Path

from setuptools import find_packages, setup

# the range parallelize is tested on (it reads transformers' private attention API: parallel_attention/hf/
# transformers_api.py checks the same range at run time)
TRANSFORMERS = "transformers>=5.0,<6"


def read_version() -> str:
    """__version__ from parallel_attention/version.py, read as text: importing the package would need torch."""
    text = (Path(__file__).parent / "parallel_attention" / "version.py").read_text(encoding="utf-8")
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    if match is None:
        raise RuntimeError("parallel_attention/version.py holds no __version__ = \"X.Y.Z\" line")
    return match.group(1)


# torch: the oldest release anything here is tested or checked against (2.11's varlen_attn, read by signature;
# the CPU suite runs 2.13)
TORCH = "torch>=2.11"


setup(
    name="parallel_attention",
    version=read_version(),
    description="Megatron-style tensor-parallel self-attention and parallel layers for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["parallel_attention", "parallel_attention.*"]),
    python_requires=">=3.10",
    install_requires=[TORCH, "numpy", "pyyaml", "safetensors", "matplotlib", "tqdm", "tokenizers"],
    extras_require={
        "hf": [TRANSFORMERS],
        "tb": ["tensorboard"],
        "data": ["pyarrow", "datasets"],  # .parquet corpora, datasets save_to_disk directories
        # the baselines of benchmarks/benchmark_attention.py (fairscale) and benchmark_training.py (transformers)
        "bench": ["fairscale==0.4.13", TRANSFORMERS, "accelerate"],  # accelerate: transformers' tp_plan
        # tests/test_fp8_torchao_oracle.py's oracle (torchao's Float8Linear, emulated); never needed to run
        "oracle": ["torchao>=0.18"],
        "dev": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3", "hypothesis>=6", TRANSFORMERS, "accelerate", "tensorboard", "pyarrow", "datasets"],
    },
)
