"""Shared test setup: offline Hugging Face, one thread, repository root importable.

The environment variables are set at import time, before anything imports transformers (set
later they have no effect and ``from_pretrained`` would try the network).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
# The CLI caches plans; tests must neither read a stale cache nor write to the user's home.
_CACHE_DIR = tempfile.mkdtemp(prefix="autopar-test-cache-")
_CACHE_OWNER = os.getpid()
os.environ["AUTOPAR_CACHE_DIR"] = _CACHE_DIR

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_unconfigure(config: object) -> None:
    """Remove the session's plan cache; only in the process that made it (a forked rank or an
    xdist worker that imported this module has another pid and leaves it alone)."""
    if os.getpid() == _CACHE_OWNER:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
