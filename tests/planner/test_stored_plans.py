"""Refactors keep plans: every stored case re-planned now equals its stored JSON, field by field
(apart from wall-clock timings and the version). See stored_plans/cases.py for how to re-store
the cases after a change meant to change plans."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.planner.stored_plans.cases import CASES, make, normalize, path_of


def _differences(stored: Any, now: Any, path: str = "") -> list[str]:
    if isinstance(stored, dict) and isinstance(now, dict):
        out = [f"{path}.{k}: stored only" for k in stored.keys() - now.keys()]
        out += [f"{path}.{k}: new field" for k in now.keys() - stored.keys()]
        for k in stored.keys() & now.keys():
            out += _differences(stored[k], now[k], f"{path}.{k}")
        return out
    if isinstance(stored, list) and isinstance(now, list):
        if len(stored) != len(now):
            return [f"{path}: {len(stored)} entries stored, {len(now)} now"]
        return [
            d
            for k, (a, b) in enumerate(zip(stored, now))
            for d in _differences(a, b, f"{path}[{k}]")
        ]
    if isinstance(stored, float) and isinstance(now, (int, float)):
        # JSON round trip of floats is exact; the tolerance only absorbs summation order.
        same = math.isclose(stored, now, rel_tol=1e-12, abs_tol=1e-15)
        return [] if same else [f"{path}: {stored!r} stored, {now!r} now"]
    return [] if stored == now else [f"{path}: {stored!r} stored, {now!r} now"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stored_plan_is_planned_again_unchanged(case):
    stored = normalize(json.loads(path_of(case).read_text()))
    now = json.loads(json.dumps(make(case), sort_keys=True))
    differences = _differences(stored, now)
    assert not differences, f"{len(differences)} differences:\n" + "\n".join(differences[:40])


def test_the_comparison_sees_a_changed_layout():
    stored = json.loads(path_of(CASES[0]).read_text())
    changed = json.loads(json.dumps(stored))
    changed["nodes"][3]["outputs"] = [["R"] * 9]
    assert _differences(stored, changed)
    assert not _differences(stored, json.loads(json.dumps(stored)))
