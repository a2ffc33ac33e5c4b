"""Packaging: the repository root is the import namespace ``moetron``.

Each library folder at the root becomes a subpackage (``core`` -> ``moetron.core`` ...);
``moetron`` itself is a namespace package, so nothing is installed as a bare ``core`` or ``data``.
"""

from setuptools import find_packages, setup

LIBRARY_FOLDERS = ("core", "models", "parallel", "data", "run")

packages = []
package_dir = {}
for folder in LIBRARY_FOLDERS:
    for sub in [folder] + [f"{folder}.{p}" for p in find_packages(folder)]:
        name = f"moetron.{sub}"
        packages.append(name)
        package_dir[name] = sub.replace(".", "/")

setup(
    name="moetron",
    version="0.1.0",
    description="Pre-training large mixture-of-experts language models in PyTorch",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=packages,
    package_dir=package_dir,
    package_data={"moetron.data": ["*.txt"]},
    install_requires=[
        "torch>=2.11",
        "triton; platform_system == 'Linux'",
        "numpy",
        "sentencepiece",
        "pyyaml",
        "safetensors",
    ],
    extras_require={
        # wandb stays out of the tests' extra (heavy): its test skips without it.
        "test": ["pytest", "pytest-xdist", "transformers", "tokenizers", "tensorboard", "matplotlib", "torchao"],
        "te": ["transformer-engine[pytorch]"],
        # Experiment tracking and plots: --logging.tensorboard, --logging.wandb, tools/plot.py.
        "track": ["tensorboard", "wandb", "matplotlib"],
    },
)
