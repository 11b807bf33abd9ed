"""The version of graphrt: the one place it is written (read by pyproject.toml and
``graphrt.__version__``)."""
__version__ = "0.1.0"
