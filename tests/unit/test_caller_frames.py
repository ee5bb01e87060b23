"""The first plan in a process must not keep the caller's frames (and their locals) alive.

pulp keeps, on the classes of the solvers it cannot load, the exception raised while loading
them; its traceback holds the frames that were running when pulp was first imported. autopar
imports pulp on the first solve, so the user's unsharded model, held by the frames of
``autopar.plan`` / ``autoparallelize``, stayed alive for the whole process.
``solver.ilp`` drops those tracebacks; each case runs in a fresh interpreter, where pulp is
imported by the call under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_MODEL = """
import gc, os, socket, sys, weakref
import torch
import autopar
from autopar.models import GPT, GPTConfig

def make():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, n_layer=2, n_embd=32, n_head=4, block_size=16))

def batch():
    idx = torch.randint(0, 128, (4, 16))
    return idx, idx
"""

_PLAN = """
def user_code():
    model = make()
    autopar.plan(model, autopar.Mesh.spec((2,)), batch())
    return weakref.ref(model)

assert "pulp" not in sys.modules
ref = user_code()
gc.collect()
assert "pulp" in sys.modules
print("ALIVE" if ref() is not None else "FREED")
"""

_PARALLELIZE = """
import torch.distributed as dist

def user_code():
    model = make()
    pmodel = autopar.autoparallelize(model, autopar.Mesh.from_world((1,)), batch())
    loss = pmodel(*pmodel.shard_inputs(*batch()))
    loss.backward()
    return weakref.ref(model), pmodel

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
assert "pulp" not in sys.modules
ref, pmodel = user_code()
gc.collect()
assert "pulp" in sys.modules
print("ALIVE" if ref() is not None else "FREED")
dist.destroy_process_group()
"""


def _run(body: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_MODEL) + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("body", [_PLAN, _PARALLELIZE], ids=["plan", "autoparallelize"])
def test_the_model_is_freed_after_the_first_solve(body: str) -> None:
    assert _run(body) == "FREED"
