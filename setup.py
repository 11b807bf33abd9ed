"""graphrt: a CUDA-graph-first decode runtime for Mixture-of-Experts models.

One distribution, one import package. The top-level folders ``capture/`` and ``kernels/``
install as ``graphrt.capture`` and ``graphrt.kernels`` (PyPI already has unrelated
``capture`` and ``kernels`` packages, so they never install under their folder names).
"""
from setuptools import setup

setup(
    name="graphrt",
    version="0.1.0",
    description="CUDA-graph-first decode runtime for Mixture-of-Experts models",
    python_requires=">=3.10",
    packages=[
        "graphrt",
        "graphrt.comm",
        "graphrt.moe",
        "graphrt.bench",
        "graphrt.cli",
        "graphrt.testing",
        "graphrt.capture",
        "graphrt.kernels",
    ],
    package_dir={
        "graphrt": "graphrt",
        "graphrt.capture": "capture",
        "graphrt.kernels": "kernels",
    },
    install_requires=[
        "torch>=2.6",
        "numpy",
        "tqdm",
        "rich",
    ],
    extras_require={
        # triton>=3.9: the CPU interpreter of older releases breaks with numpy 2.5.
        "dev": ["pytest>=7", "triton>=3.9", "matplotlib"],
        # Versions tested on the H200 machines (torch 2.11+cu130, Python 3.12); see README.
        "gpu": [
            "triton>=3.1",
            "tokenspeed-deepep==1.2.1.post20251110",
            "tokenspeed-deepgemm==2.5.0.post20260424",
        ],
    },
    entry_points={"console_scripts": ["graphrt = graphrt.cli.main:main"]},
)
