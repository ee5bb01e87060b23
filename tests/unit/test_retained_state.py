"""What a parallel module and a process keep after ``autoparallelize``.

Two mechanisms, each checked in a fresh interpreter (one gloo rank, a tiny GPT, the ``fsdp``
recipe: ZeRO-3, so the runtime also holds its own copy of the lowered graph):

* the graphs the module runs (train and eval, ZeRO's copy included) carry no capture-time node
  metadata: no fake tensor, FakeTensorMode, ShapeEnv or exported program is reachable from the
  module, and every node's ``meta`` holds only autopar's own entries
  (``autopar.lowering.drop_capture_meta``);
* building modules one after another does not pile up captures: ``input_nodes`` once kept a
  memo whose values held each node's inputs, hence every graph it saw, fake tensors and all,
  for the whole process. The live fake tensors after a third build are no more than after the
  second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

from autopar.strategies.registry import input_nodes

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import gc, json, socket
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
import autopar
from autopar.models import GPT, GPTConfig
from benchmarks.module_heap import reachable

KINDS = ("FakeTensor", "FakeTensorMode", "ShapeEnv", "ExportedProgram")

def batch():
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 128, (4, 16), generator=gen)
    return idx, idx

def build():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, n_layer=2, n_embd=32, n_head=4, block_size=16))
    pmodel = autopar.autoparallelize(
        model, autopar.Mesh.from_world((1,)), batch(), recipe="fsdp", price_baselines=False
    )
    pmodel(*pmodel.shard_inputs(*batch())).backward()
    pmodel.eval()
    with torch.no_grad():
        pmodel(*pmodel.shard_inputs(*batch()))
    pmodel.train()
    return pmodel

def live_fakes():
    gc.collect()
    return sum(isinstance(o, FakeTensor) for o in gc.get_objects())

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
pmodel = build()
gc.collect()
counts, graphs = reachable(pmodel)
found = {kind: counts[kind] for kind in KINDS}
foreign = sorted({k for g in graphs for n in g.graph.nodes for k in n.meta
                  if not k.startswith("autopar_")})
num_graphs = len(graphs)
del pmodel, graphs
counts = []
for _ in range(2):
    build()
    counts.append(live_fakes())
print(json.dumps({"reachable": found, "num_graphs": num_graphs, "foreign_meta": foreign,
                  "live_fakes": counts}))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def retained() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_parallel_module_reaches_no_capture_state(retained: dict[str, Any]) -> None:
    assert retained["reachable"] == {
        "FakeTensor": 0,
        "FakeTensorMode": 0,
        "ShapeEnv": 0,
        "ExportedProgram": 0,
    }
    # The train graph, ZeRO's copy of it, the eval graph and ZeRO's copy of that.
    assert retained["num_graphs"] >= 4
    assert retained["foreign_meta"] == []


def test_builds_do_not_pile_up_captures(retained: dict[str, Any]) -> None:
    second, third = retained["live_fakes"]
    assert third <= second, retained["live_fakes"]


def test_input_nodes_in_flatten_order_with_repeats() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    mul = graph.call_function(torch.mul, (x, x))
    cat = graph.call_function(torch.cat, ([y, x, y],), {"dim": 0})
    where = graph.call_function(torch.where, (mul,), {"input": y, "other": {"b": x, "a": mul}})
    assert input_nodes(mul) == [x, x]
    assert input_nodes(cat) == [y, x, y]
    assert input_nodes(where) == [mul, y, x, mul]
