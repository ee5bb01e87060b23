"""``autopar plan --jobs N`` / AUTOPAR_PLAN_JOBS (issue 16, side by side): with two jobs the
ZeRO search bounds a configuration in a worker process beside the next one
(autopar/planner/bound_ahead.py) and finds the plan, bounds and skips of one job; a worker
that gives no answer (it died, or raised) is evaluated here after all, so its error is this
process's; a bad AUTOPAR_PLAN_JOBS is a clear error (tiny GPT on a 2x2 mesh at a budget that
binds, every problem large enough to go side by side)."""

from __future__ import annotations

import json
import re

import pytest

from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner import bound_ahead
from solver.background import start_priced_bound
from tests.models import tiny_gpt

BUDGET = 1_900_000  # binds on 2x2: one bound goes to a worker beside another (checked below;
# since session 31 searches the first seed where its plan fits best, 1.8 MB bounds none aside)
MESH = "2x2"
TIMED = ("seconds", "timings", "solve_s", "build_s", "time_s", "wall", "elapsed", "created")


def _untimed(value):
    """The plan document without its timings."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not any(t in k for t in TIMED)}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _plan(monkeypatch, jobs: str, started: list[int]) -> tuple[dict, list[str]]:
    """The tiny GPT planned with AUTOPAR_PLAN_JOBS=``jobs``: the plan without timings and
    the progress lines without their times; ``started`` counts the workers started."""
    monkeypatch.setenv(bound_ahead.JOBS_ENV, jobs)
    monkeypatch.setattr(bound_ahead, "JOBS_AHEAD_ENTRIES", 0)  # every problem goes aside

    def counting(*args, **kwargs):
        started.append(1)
        return start_priced_bound(*args, **kwargs)

    monkeypatch.setattr(bound_ahead, "start_priced_bound", counting)
    return _plan_tiny()


def _plan_tiny() -> tuple[dict, list[str]]:
    """The tiny GPT planned on MESH under BUDGET: its plan JSON and progress lines, untimed."""
    model, args, kwargs = tiny_gpt()
    lines: list[str] = []
    plan = plan_captured(
        capture(model, args, kwargs),
        Mesh.parse(MESH, device="h100"),
        PlanOptions(memory_budget=BUDGET, gap=0.01),
        model_name="tiny-gpt",
        progress=lines.append,
    )
    return _untimed(json.loads(plan.to_json())), _lines(lines)


def _lines(lines: list[str]) -> list[str]:
    """Progress lines without their times, the note that a bound was held and the count of
    priced solves a relaxation reused (a worker's priced solves stay in the worker)."""
    return [
        re.sub(r"[0-9.]+ s\b", "_ s", re.sub(r"\d+ priced solves? reused, ", "", line)).replace(
            " (evaluated beside an earlier bound)", ""
        )
        for line in lines
    ]


def test_two_jobs_find_the_plan_bounds_and_skips_of_one(monkeypatch) -> None:
    one: list[int] = []
    two: list[int] = []
    serial = _plan(monkeypatch, "1", one)
    beside = _plan(monkeypatch, "2", two)
    assert not one and two  # side by side only with two jobs
    assert beside[1] == serial[1]  # every bound, skip and solve line
    assert beside[0] == serial[0]


def test_a_worker_without_an_answer_is_evaluated_here(monkeypatch) -> None:
    serial = _plan(monkeypatch, "1", [])

    class Died:
        def result(self):
            return None  # what BoundJob.result gives for a dead or raising worker

    started: list[int] = []

    def dying(*args, **kwargs):
        started.append(1)
        return Died()

    monkeypatch.setattr(bound_ahead, "start_priced_bound", dying)
    monkeypatch.setenv(bound_ahead.JOBS_ENV, "2")
    monkeypatch.setattr(bound_ahead, "JOBS_AHEAD_ENTRIES", 0)
    ahead = bound_ahead.Ahead()
    assert ahead.min_entries == 0
    plan, lines = _plan_tiny()
    assert started
    assert lines == serial[1]
    assert plan == serial[0]


@pytest.mark.parametrize("text", ["0", "-1", "two"])
def test_a_bad_jobs_value_is_a_clear_error(monkeypatch, text: str) -> None:
    monkeypatch.setenv(bound_ahead.JOBS_ENV, text)
    with pytest.raises(ValueError, match="AUTOPAR_PLAN_JOBS"):
        bound_ahead.Ahead()


def test_one_job_is_the_serial_path(monkeypatch) -> None:
    monkeypatch.delenv(bound_ahead.JOBS_ENV, raising=False)
    assert bound_ahead.plan_jobs() == bound_ahead.DEFAULT_JOBS == 1
    assert bound_ahead.Ahead().min_entries is None
    monkeypatch.setenv(bound_ahead.JOBS_ENV, "2")
    assert bound_ahead.Ahead().min_entries == bound_ahead.JOBS_AHEAD_ENTRIES


def test_the_lead_bounded_aside_finds_the_plan_of_one_process(monkeypatch) -> None:
    """zero_search with skip_ahead's lead bounded in a worker (skip_ahead.Pending): the search
    goes on with the others and takes the lead and its followers last, skipped or, as here
    (the lead's bound is under the line), seeded and taken then; the plan is one process's,
    within the gap of its bound."""
    from autopar.planner import skip_ahead

    serial = _plan(monkeypatch, "1", [])
    started: list[int] = []

    def counting(*args, **kwargs):
        started.append(1)
        return start_priced_bound(*args, **kwargs)

    monkeypatch.delenv(bound_ahead.JOBS_ENV)
    monkeypatch.setattr(skip_ahead, "ASIDE_ENTRIES", 0)
    monkeypatch.setattr(skip_ahead, "usable_cores", lambda: 2)
    monkeypatch.setattr(skip_ahead, "start_priced_bound", counting)
    plan, lines = _plan_tiny()
    assert started == [1]
    aside = [k for k, line in enumerate(lines) if line.endswith("(in a worker beside the search)")]
    assert len(aside) == 1, lines
    # Its bound is under the line: the lead and its follower are seeded and taken after it.
    later = lines[aside[0] + 1 :]
    assert any(line.startswith("primal:") for line in later), lines
    assert any(line.startswith(("ZeRO ", "skip ZeRO ")) for line in later), lines
    assert plan["solver"]["objective_s"] == serial[0]["solver"]["objective_s"]
    assert plan["nodes"] == serial[0]["nodes"]
    bound, step = plan["solver"]["bound_s"], plan["solver"]["objective_s"]
    assert step * (1 - 0.01) <= bound * (1 + 1e-9) and bound <= step
    stages = sorted(tuple(c["zero_stages"]) for c in plan["solver"]["candidates"])
    assert stages == sorted(tuple(c["zero_stages"]) for c in serial[0]["solver"]["candidates"])
