"""The plan summary (issue 14 item 1): the data it is drawn from, and the text at a width.

The summary is a pure function of the plan JSON (``autopar.plan.summary.summary_data``), so the
data tests take one small plan and check what a reader is told: what was chosen in words, the
headline figures (MFU recomputed from its definition), the recipes, and the blocks in model
order with one unit per column.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

import autopar
from autopar.capture.flops import node_costs
from autopar.models import MLP, MLPConfig
from autopar.plan.document import Plan
from autopar.plan.render import render_summary
from autopar.plan.summary import block_of, summary_data
from tests.models import tiny_gpt


@pytest.fixture(scope="module")
def gpt_plan() -> Plan:
    model, args, _ = tiny_gpt()
    return autopar.plan(model, autopar.Mesh.spec((2, 2), ("dp", "tp"), device="h100"), args)


@pytest.fixture(scope="module")
def wide_mlp_plan() -> Plan:
    with torch.device("meta"):
        model = MLP(MLPConfig(in_features=4096, hidden=32768, out_features=4096))
        x, y = torch.randn(8, 4096), torch.randn(8, 4096)
    return autopar.plan(model, autopar.Mesh.spec((4,), device="h100"), (x, y))


def test_blocks_come_in_model_order_with_alike_layers_merged(gpt_plan: Plan) -> None:
    data = summary_data(gpt_plan.data)
    names = [b["name"] for b in data["blocks"]]
    # Graph order of first use, not alphabetical: embeddings, the layers, the final norm, the head.
    order = []
    for entry in gpt_plan.data["nodes"]:
        block = block_of(entry["module_path"])
        if entry["kind"] == "op" and block not in order:
            order.append(block)
    merged = [n for n in names if "-" in n]
    for name in names:
        first = name if "-" not in name else name.split("-")[0]
        assert first in order, (name, order)
    assert [n.split("-")[0] for n in names if n.split("-")[0] in order] == sorted(
        (n.split("-")[0] for n in names if n.split("-")[0] in order), key=order.index
    )
    assert names != sorted(names), "blocks must not be alphabetical"
    # Merged blocks count their members, and every parameter appears exactly once per block.
    for block in data["blocks"]:
        if block["name"] in merged:
            assert block["count"] == block["last"] - block["first"] + 1 >= 2
    shown = sum(len(b["params"]) * b["count"] for b in data["blocks"])
    assert shown == len(gpt_plan.data["params"])


def test_parameters_are_listed_in_order_of_first_use(gpt_plan: Plan) -> None:
    d = gpt_plan.data
    first_use = {}
    for k, entry in enumerate(d["nodes"]):
        for arg in entry.get("args", []):
            first_use.setdefault(arg, k)
    node_of = {e["fqn"]: e["name"] for e in d["nodes"] if e["kind"] == "param" and e.get("fqn")}
    for block in summary_data(d)["blocks"]:
        base = block["name"].split("-")[0]
        fqns = [
            f"{base}.{name}" if base != "(top)" and not name.startswith(base) else name
            for name, _ in block["params"]
        ]
        uses = [
            first_use[node_of[f]] for f in fqns if node_of.get(f) in first_use
        ]  # tied: one is used
        assert uses == sorted(uses), block["name"]


def test_headline_figures_and_mfu_follow_their_definitions(wide_mlp_plan: Plan) -> None:
    d = wide_mlp_plan.data
    h = summary_data(d)["headline"]
    assert h["step_s"] == d["predicted"]["step_s"]
    assert h["peak_memory_bytes"] == d["predicted"]["peak_memory_bytes"]
    assert h["budget_bytes"] == d["memory_budget_bytes"]
    # The MLP's work is its two matmuls of 8 x 4096 x 32768 multiply-adds (2 FLOPs each):
    # forward, the weight gradient, and the input gradient of the second only (x needs none).
    flops = d["model"]["train_flops"]
    assert flops == pytest.approx((2 + 2 + 2 + 2 + 2) * 8 * 4096 * 32768, rel=0.01)
    peak = d["mesh"]["device"]["peak_flops"]["float32"]
    assert h["mfu"] == pytest.approx(flops / (d["predicted"]["step_s"] * peak * 4), rel=1e-12)
    assert 0 < h["mfu"] < 1
    old = copy.deepcopy(d)
    del old["model"]["train_flops"]
    assert summary_data(old)["headline"]["mfu"] is None
    assert "MFU" not in render_summary(summary_data(old), width=80)


def test_train_flops_are_the_graph_ops_forward_and_backward(gpt_plan: Plan) -> None:
    gm = gpt_plan.space.captured.gm
    ops = {e["name"] for e in gpt_plan.data["nodes"] if e["kind"] == "op"}
    total = sum(
        node_costs(n).fwd_flops + node_costs(n).bwd_flops for n in gm.graph.nodes if n.name in ops
    )
    assert gpt_plan.data["model"]["train_flops"] == pytest.approx(total, rel=1e-12) and total > 0


def test_sentence_names_the_parallelism_in_words(wide_mlp_plan: Plan, gpt_plan: Plan) -> None:
    assert summary_data(wide_mlp_plan.data)["sentence"].startswith("Tensor parallel on a0")
    replicated = copy.deepcopy(gpt_plan.data)
    for p in replicated["params"].values():
        p["placement"] = "R,R"
    for e in replicated["nodes"]:
        e["outputs"] = ["R,R" if o else o for o in e["outputs"]]
    assert summary_data(replicated)["sentence"] == "Replicated: no parallelism pays at this size"
    ddp = copy.deepcopy(replicated)
    for e in ddp["nodes"]:
        if e["kind"] == "op":
            e["outputs"] = ["S0,S0" if o else o for o in e["outputs"]]
    ddp["zero"].update(stage=1, axes=["dp", "tp"], stages={"dp": 1, "tp": 1})
    ddp["checkpoint"]["segments"] = [
        {
            "module_path": "blocks.0.mlp",
            "nodes": [],
            "keep": [],
            "policy": "full",
            "saved_bytes": 1.0,
            "recompute_s": 1.0,
        }
    ]
    text = summary_data(ddp)["sentence"]
    assert text == "Data parallel on dp,tp, ZeRO-1 on dp,tp, 1 of 2 layers recomputed"
    ddp["params"]["wte.weight"]["placement"] = "S0,R"
    ddp["recipe"] = "fsdp"
    assert summary_data(ddp)["sentence"].startswith(
        "Recipe fsdp: data parallel on dp,tp (some weights split on dp too), ZeRO-1"
    )


def test_recipes_start_with_this_plan_in_a_fixed_order(gpt_plan: Plan) -> None:
    rows = summary_data(gpt_plan.data)["recipes"]
    assert rows[0]["plan"] == "auto" and rows[0]["this_plan"] and rows[0]["vs_this"] == 1.0
    assert [r["plan"] for r in rows[1:]] == [
        r for r in ("ddp", "fsdp", "megatron", "fsdp+tp") if r in gpt_plan.baselines
    ]
    for row in rows[1:]:
        assert row["step_s"] == gpt_plan.baselines[row["plan"]]["step_s"]


@pytest.mark.parametrize("width", [80, 120])
def test_text_fits_the_width_and_each_column_has_one_unit(gpt_plan: Plan, width: int) -> None:
    for verbose in (False, True):
        text = gpt_plan.summary(width=width, verbose=verbose)
        assert max(len(line) for line in text.splitlines()) <= width, text
        assert text.isascii()
    text = gpt_plan.summary(width=width)
    # Units are named once in each section title; the cells are bare numbers.
    table = text.split("Recipes under the same cost model")[1].split("\n\n")[0].splitlines()
    assert re.search(
        r"\(time in (s|ms|us), peak memory in (B|KiB|MiB|GiB|TiB) per device\)", table[0]
    )
    for line in table[3:]:
        assert not re.search(r"\d (s|ms|us|B|KiB|MiB|GiB)\b", line), line
    # Decimals are aligned down each numeric column.
    for line in table[3:]:
        cells = line.split()
        assert all(re.fullmatch(r"[\d.]+x?|yes|NO|\(this\)|[\w+]+", c) for c in cells), line


def test_unwrapped_without_a_width(gpt_plan: Plan) -> None:
    text = gpt_plan.summary()
    narrow = gpt_plan.summary(width=80)
    assert len(text.splitlines()) < len(narrow.splitlines())
    for block in summary_data(gpt_plan.data)["blocks"]:
        if block["params"]:
            line = "  " + "  ".join(f"{n}={p}" for n, p in block["params"])
            assert line in text.splitlines()


def test_verbose_adds_the_zero_tables_and_the_default_leaves_them_out(gpt_plan: Plan) -> None:
    short = gpt_plan.summary(width=80)
    long = gpt_plan.summary(width=80, verbose=True)
    for needle in ("ZeRO configurations considered", "ZeRO choice:", "Solver "):
        assert needle in long and needle not in short
    assert long.startswith(short)
    assert short.splitlines()[0] == summary_data(gpt_plan.data)["sentence"] + "."


def test_loaded_plan_summarises_exactly_like_the_live_one(gpt_plan: Plan) -> None:
    loaded = Plan.from_json(gpt_plan.to_json())
    for width in (None, 80):
        for verbose in (False, True):
            assert loaded.summary(width=width, verbose=verbose) == gpt_plan.summary(
                width=width, verbose=verbose
            )


def test_mfu_is_finite_and_shown(gpt_plan: Plan) -> None:
    h = summary_data(gpt_plan.data)["headline"]
    assert h["mfu"] is not None and math.isfinite(h["mfu"])
    assert f"MFU {h['mfu']:.1%}" in gpt_plan.summary(width=80)
