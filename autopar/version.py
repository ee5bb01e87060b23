"""autopar's version, and a fingerprint of the code that makes plans.

The version is the installed distribution's (``pyproject.toml``). A plan cached by one build of
the planner must not be served by another, and the version is not bumped for every change, so
the plan cache keys on :func:`code_fingerprint` too: a sha256 over the source of every package
whose code decides a plan (``autopar``, ``solver``, ``cost_models``). Reading about 100 files
takes a few milliseconds, once per process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import pathlib

_FALLBACK = "0.1.0"
"""The version when autopar runs from a source tree that was never installed."""


def version() -> str:
    try:
        return importlib.metadata.version("autopar")
    except importlib.metadata.PackageNotFoundError:
        return _FALLBACK


@functools.cache
def code_fingerprint() -> str:
    """sha256 (hex) of the planner's source: every ``.py`` and ``.json`` file of the packages
    ``autopar``, ``solver`` and ``cost_models``, in sorted path order, names included."""
    import cost_models
    import solver

    digest = hashlib.sha256()
    here = pathlib.Path(__file__).resolve().parent
    for package in (
        here,
        pathlib.Path(solver.__file__).parent,
        pathlib.Path(cost_models.__file__).parent,
    ):
        for path in sorted(package.rglob("*")):
            if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
                digest.update(f"{package.name}/{path.relative_to(package).as_posix()}\n".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


__version__ = version()
