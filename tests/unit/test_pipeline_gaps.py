"""The pipeline gaps' diagnostic: the gap classifier (benchmarks/pipeline_gaps.py) and the
point-to-point record (autopar/runtime/p2p_trace.py)."""

from __future__ import annotations

import json

import pytest

from autopar.runtime import p2p_trace
from benchmarks.pipeline_gaps import Gap, read_p2p, split_gap, step_gaps


def _step(tasks_by_rank: list[list[tuple[str, float, float]]]) -> list:
    return [[0.0, 10.0, [list(t) for t in tasks]] for tasks in tasks_by_rank]


def test_gaps_are_local_or_remote_from_the_later_of_their_two_ready_moments() -> None:
    # 2 ranks, GPipe, 2 microbatches: rank 0 runs F0 F1 B0 B1, rank 1 the same.
    ranks = _step([
        [("F", 0.0, 1.0), ("F", 1.1, 2.0), ("B", 5.0, 6.0), ("B", 6.2, 7.0)],
        [("F", 1.2, 2.2), ("F", 2.5, 3.5), ("B", 3.6, 4.5), ("B", 4.6, 5.0)],
    ])  # fmt: skip
    gaps = {(g.rank, g.kind, round(g.start, 3)): g for g in step_gaps(ranks, "gpipe", 2)}
    assert len(gaps) == 6  # every task but each rank's first
    f1 = gaps[(1, "F", 2.5)]  # its input (rank 0's F1, ended 2.0) was there before its F0 ended
    assert f1.local and f1.ready == 2.2 and f1.seconds == pytest.approx(0.3)
    b0 = gaps[(0, "B", 5.0)]  # waited for rank 1's B0 (ended 4.5) after its own F1 (2.0)
    assert not b0.local and b0.ready == 4.5 and b0.seconds == pytest.approx(0.5)
    assert b0.previous_s == pytest.approx(0.9)
    b1 = gaps[(0, "B", 6.2)]
    assert b1.local and b1.seconds == pytest.approx(0.2)
    assert all(g.others == 0 for g in gaps.values())


def test_the_other_ranks_in_a_task_are_counted_at_the_ready_moment() -> None:
    ranks = _step([
        [("F", 0.0, 1.0), ("F", 1.5, 2.0), ("B", 6.0, 7.0), ("B", 7.0, 8.0)],
        [("F", 0.5, 3.0), ("F", 3.0, 4.0), ("B", 4.0, 5.0), ("B", 5.0, 6.0)],
    ])  # fmt: skip
    f1 = next(g for g in step_gaps(ranks, "gpipe", 2) if (g.rank, g.kind) == (0, "F"))
    assert f1.ready == 1.0 and f1.others == 1  # rank 1's F0 ran from 0.5 to 3.0


def test_a_gap_splits_into_posting_waiting_and_the_rest() -> None:
    gap = Gap(rank=0, kind="F", local=True, ready=0.0, start=1.0, previous_s=1.0, others=0)
    spans = [("post", 0.1, 0.3), ("wait", 0.5, 2.0), ("post", -1.0, -0.5)]
    split = split_gap(gap, spans)
    assert split == pytest.approx({"post": 0.2, "wait": 0.5, "other": 0.3})


def test_the_record_wraps_the_schedules_posts_and_waits_and_restores_them(tmp_path) -> None:
    import torch.distributed.pipelining.schedules as schedules

    post, wait = schedules._batch_p2p, schedules._wait_batch_p2p
    p2p_trace.install(str(tmp_path), rank=3)
    try:
        assert schedules._batch_p2p is not post and schedules._wait_batch_p2p is not wait
        assert schedules._batch_p2p([], desc="fwd_send") == []
        schedules._wait_batch_p2p([])
    finally:
        p2p_trace.uninstall()
    assert schedules._batch_p2p is post and schedules._wait_batch_p2p is wait
    lines = [json.loads(x) for x in (tmp_path / "p2p-3.jsonl").read_text().splitlines()]
    assert [x[:3] for x in lines] == [["post", "fwd_send", 0], ["wait", "", 0]]
    assert all(x[3] <= x[4] for x in lines)
    assert read_p2p(str(tmp_path)) == {3: [(x[0], x[3], x[4]) for x in lines]}


def test_nothing_is_recorded_without_the_variable(monkeypatch) -> None:
    monkeypatch.delenv(p2p_trace.ENV, raising=False)
    assert p2p_trace.trace_directory() is None
    monkeypatch.setenv(p2p_trace.ENV, "/tmp/x")
    assert p2p_trace.trace_directory() == "/tmp/x"
