"""Plan cache: a planned graph is not planned twice.

Key (DESIGN.md, Conventions): the canonical graph hash, the mesh (shape, axis names, links
and the device profile, as ``Mesh.to_dict`` writes them in full), every plan option (recipe
included), the autopar version and a fingerprint of the planner's source
(``autopar.version.code_fingerprint``: any change to the code that makes plans is a new key),
hashed with sha256 over canonical JSON. Entries are plan
JSON files in ``$AUTOPAR_CACHE_DIR`` or ``~/.cache/autopar/plans``; a file that no longer
reads as a valid plan for the graph is ignored and overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from autopar.errors import PlanMismatchError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan.document import Plan
from autopar.version import code_fingerprint, version

CACHE_ENV = "AUTOPAR_CACHE_DIR"


def cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR`` or ``~/.cache/autopar/plans``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "autopar" / "plans"


def cache_key(graph_hash: str, mesh: Mesh, options: PlanOptions, model_name: str = "") -> str:
    """sha256 of the key fields (``model_name`` too: it is written into the plan)."""
    document = {
        "graph_hash": graph_hash,
        "model_name": model_name,
        "mesh": mesh.to_dict(),
        "options": options.to_dict(),
        "autopar_version": version(),
        "code": code_fingerprint(),
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str, graph_hash: str, directory: Path | None = None) -> Plan | None:
    """The cached plan for ``key``, or None when there is none or it does not read back."""
    path = (directory or cache_dir()) / f"{key}.json"
    if not path.is_file():
        return None
    try:
        return Plan.load(path, expected_hash=graph_hash)
    except (ValueError, PlanMismatchError, OSError):
        return None


def store(key: str, plan: Plan, directory: Path | None = None) -> Path:
    """Write ``plan`` under ``key`` atomically (a rename), creating the directory."""
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(plan.to_json())
        f.write("\n")
    os.replace(tmp, path)
    return path
