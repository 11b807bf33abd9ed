"""The package layout, the one thing pyproject.toml's ``[project]`` table cannot say briefly.

One distribution, one import package. The top-level folders ``capture/`` and ``kernels/``
install as ``graphrt.capture`` and ``graphrt.kernels`` (PyPI already has unrelated
``capture`` and ``kernels`` packages, so they never install under their folder names).
Everything else (name, version, requirements, extras, the ``graphrt`` command) is in
pyproject.toml.
"""
from setuptools import setup

setup(
    packages=[
        "graphrt",
        "graphrt.comm",
        "graphrt.moe",
        "graphrt.eplb",
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
)
