"""Faithful CPU fakes of libraries that cannot load on our machines (see each module's docstring).

A fake follows the library's *documented* API (signatures, defaults, return tuples, layouts) and
is made falsifiable: results that are not valid yet read as NaN, and every call's flags are
recorded so tests can assert how a backend drove it.
"""
