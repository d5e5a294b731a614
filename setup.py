"""gigrl: JAX/TPU-native RL for LLM search agents."""
import setuptools

CORE = [
    # Tested with jax 0.10.2 / flax 0.12.8 (the newest releases for Python 3.11 when pinned). jax
    # 0.11.x is admitted for the CUDA image of the GPU machines (jax 0.11.2, Python 3.12), whose own
    # build is kept; a runtime that ships a jax 0.10/0.11 (e.g. Colab) keeps its build too.
    # Older jax/flax lines were not tested, so they are not allowed.
    "jax>=0.10,<0.12",
    "flax>=0.12,<0.14",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.11",
    "ml-collections>=1.0",
    "tensorflow-datasets>=4.9.7",
    "array-record>=0.8",
    "sentencepiece>=0.2",
    "chex>=0.1.90",
    "bm25s>=0.2.10",
    "rapidfuzz>=3.9",  # exact LCS bound for similarity anchors (C++)
    "safetensors>=0.4",
    "gguf>=0.10",  # gigrl-fetch: reads and dequantizes llama.cpp GGUF checkpoints
    "huggingface_hub>=0.23",  # model.hf_path as a hub id (snapshot_download)
    "tokenizers>=0.20",
    "jinja2>=3.1",  # renders a checkpoint's own chat template (data/hf_tokenizer.py)
    "tqdm>=4.66",
    "numpy>=1.26",
    "matplotlib>=3.8",
    "absl-py>=2.1",
    "importlib_resources>=6.0",  # tfds builders need it (no TensorFlow)
]
# nbclient + ipykernel: tests/test_notebooks.py runs each notebook through a real kernel.
# pytest-xdist: the suite runs one worker per core (pytest.ini: -n auto --dist loadfile).
# pytest-timeout: a test that hangs fails with every thread's stack (pytest.ini: timeout).
# pytest-rerunfailures: a test whose worker process died runs once more (pytest.ini).
TEST = ["pytest>=8", "pytest-xdist>=3.7", "pytest-timeout>=2.3", "pytest-rerunfailures>=16",
        "hypothesis>=6.100",
        "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29"]
# accelerate: transformers' own GGUF loader needs it (the GGUF parity tests' reference).
HF = ["torch==2.13.0", "transformers>=4.50", "accelerate>=1.0", "peft>=0.13"]
# benchmarks/vs_trl.py: TRL's GRPOTrainer side by side (never a core or test dependency).
BENCH = HF + ["trl>=1.0", "datasets>=3.0"]

setuptools.setup(
    name="gigrl",
    version="0.1.0",
    description="JAX/TPU-native reinforcement learning for LLM search agents "
    "(Stratified GRPO, GiGPO, HA-DW, query recycling).",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["gigrl", "gigrl.*"]),
    package_data={"gigrl": ["data/files/**/*", "data/files/*"]},
    include_package_data=True,
    install_requires=CORE,
    extras_require={"test": TEST + HF, "hf": HF, "bench": BENCH,
                    "tpu": ["jax[tpu]>=0.10,<0.11"]},
    entry_points={
        "console_scripts": [
            "gigrl-train=gigrl.cli.entry:train",
            "gigrl-convert-hf=gigrl.cli.entry:convert",
            "gigrl-compile=gigrl.cli.entry:compile_",
            "gigrl-serve-retriever=gigrl.cli.entry:serve_retriever",
            "gigrl-eval=gigrl.cli.entry:eval_",
            "gigrl-sweep=gigrl.cli.entry:sweep",
            "gigrl-fetch=gigrl.cli.entry:fetch",
            "gigrl-export=gigrl.cli.entry:export",
        ]
    },
)
