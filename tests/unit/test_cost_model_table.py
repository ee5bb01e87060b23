"""The auto-vs-recipes table of benchmarks/cost_model.py, on hand-made results."""

from __future__ import annotations

import pytest

from benchmarks.cost_model import auto_vs_recipes_rows


def _plan(mesh: str, predicted_s: float, steps: list[float]) -> dict:
    ordered = sorted(steps)
    return {"mesh": mesh, "predicted_step_s": predicted_s, "step_s": ordered[len(ordered) // 2],
            "step_times_s": steps}  # fmt: skip


def test_rows_give_the_ratio_its_spread_and_the_rank_correlation() -> None:
    plans = {
        # two repetitions of three steps: auto is 1.0 then 1.2 of ddp
        "auto@2x2": _plan("2x2", 1.0, [10, 10, 10, 12, 12, 12]),
        "ddp@2x2": _plan("2x2", 1.1, [10, 10, 10, 10, 10, 10]),
        "fsdp@2x2": _plan("2x2", 2.0, [20, 20, 20, 20, 20, 20]),
        "skipped@2x2": {"mesh": "2x2", "skipped": "not executable"},
        "auto@4": _plan("4", 1.0, [5, 5, 5, 5, 5, 5]),
        "megatron@4": _plan("4", 0.9, [9, 9, 9, 9, 9, 9]),
    }
    report = {
        "world": 4,
        "models": {"gpt": {"result": {"plans": plans}, "aliases": {"ddp@4": "auto@4"}}},
    }
    rows, table = auto_vs_recipes_rows([report], reps=2)
    by_mesh = {r["mesh"]: r for r in rows}
    square = by_mesh["2x2"]
    assert square["best"] == "ddp@2x2"
    assert (square["ratio_min"], square["ratio_max"]) == pytest.approx((1.0, 1.2))
    # predicted auto < ddp < fsdp, measured (medians 12, 10, 20) ddp < auto < fsdp
    assert square["ratio"] == pytest.approx(1.2) and square["spearman"] == pytest.approx(0.5)
    line = by_mesh["4"]
    assert line["auto_equals"] == ["ddp"] and line["ratio"] == pytest.approx(5 / 9)
    assert line["spearman"] == pytest.approx(-1.0)  # megatron predicted faster, measured slower
    assert "(= ddp)" in table and "Spearman pooled" in table
