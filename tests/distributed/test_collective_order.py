"""The runtime never hangs: collectives come in the same order on every rank, and where they do
not, check mode names both in one line within seconds and a timeout names the rank and the op.

* ``bench-cost mlp --mesh 2 --recipes fsdp`` on 2 gloo ranks completes. Before the fix it hung
  for the whole process-group timeout: rank 0 all-gathered a ZeRO-3 chunk in backward that rank
  1 never gathered (rank 1 sat in an all-reduce), because ``zero_out`` returned its input (a view
  of the gathered chunk, which the next matmul saved) on coordinate 0 and fresh zeros elsewhere,
  so only rank 0's saved tensor needed the chunk again. Run here with check mode off, as the CLI
  runs by default, and a 20 s timeout; checked: with the old ``zero_out`` it fails in seconds
  (the launcher's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reports rank 0's all_gather of 4194304
  floats against rank 1's all_reduce of 8x8192), and without DETAIL it would wait the 20 s. The
  same run through the CLI (a plain install: no matplotlib, plots skipped) completes too.
* ``zero_out`` returns a new tensor on every coordinate (what a rank's autograd graph aliases
  must not depend on its coordinate).
* Check mode (``AUTOPAR_CHECK_COLLECTIVES=1``): a deliberately mismatched pair -- a ZeRO-style
  all-gather on rank 0, an all-reduce on rank 1; the same through the autograd collectives --
  fails on both ranks with one line naming both collectives and both ranks, in seconds although
  the process-group timeout is 60 s.
* A collective a peer never joins fails after the process group's timeout naming the rank, the
  collective and the axis.
* ``pg_timeout_s`` reads ``AUTOPAR_PG_TIMEOUT_S`` and refuses nonsense in one line.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from autopar.comm.collective_check import CHECK_ENV
from tests.distributed.launcher import run_distributed

CHECK_ON = {CHECK_ENV: "1"}
CHECK_OFF = {CHECK_ENV: "0"}


# --------------------------------------------------------------------------------------------
# The bench-cost fsdp deadlock


@pytest.fixture(scope="module")
def fsdp_mlp_plans() -> dict[str, Any]:
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.report import plans_for_recipes

    model, args, kwargs = build_preset("mlp", batch=8, seq=1024)
    plans = plans_for_recipes(
        capture(model, args, kwargs), Mesh.parse("2", device="cpu"), PlanOptions(),
        recipes=["fsdp"], model_name="mlp",
    )  # fmt: skip
    return {name: plan.data for name, plan in plans.items()}


def bench_fsdp_rank(rank: int, world_size: int, plans: dict[str, Any]) -> dict[str, Any]:
    from autopar.tools.bench_cost import BenchConfig, ModelSpec, bench_on_rank

    config = BenchConfig(steps=1, warmup=1, measure_ops=False)
    return bench_on_rank(ModelSpec(name="mlp", batch=8, seq=1024), plans, config)["plans"]


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_cost_fsdp_mlp_on_two_ranks_completes(fsdp_mlp_plans: dict[str, Any]) -> None:
    results = run_distributed(
        bench_fsdp_rank, 2, fsdp_mlp_plans, pg_timeout_s=20, timeout_s=180, env=CHECK_OFF
    )
    for plans in results:
        assert "skipped" not in plans["fsdp"], plans["fsdp"]
        assert plans["fsdp"]["step_s"] > 0
    assert results[0]["fsdp"]["step_s"] == results[1]["fsdp"]["step_s"]  # the slowest rank's


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_cost_cli_fsdp_completes_and_skips_plots_without_matplotlib(tmp_path: Any) -> None:
    from tests.unit.test_optional_deps import run_cli_without_matplotlib

    out = run_cli_without_matplotlib(
        "bench-cost", "mlp", "--mesh", "2", "--recipes", "fsdp", "--no-ops", "--steps", "1",
        "--json", str(tmp_path / "bench.json"),
        cwd=str(tmp_path), env={"AUTOPAR_PG_TIMEOUT_S": "20"}, timeout_s=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "autopar: note: PNG plots skipped: matplotlib is not installed" in out.stderr
    assert "plots written" not in out.stdout
    assert not list(tmp_path.glob("*.png"))
    fsdp = json.loads((tmp_path / "bench.json").read_text())["result"]["plans"]["fsdp"]
    assert "skipped" not in fsdp and fsdp["step_s"] > 0, fsdp


# --------------------------------------------------------------------------------------------
# Check mode and timeouts (one spawn, cases in order)


def _mismatched_zero_pair(rank: int, groups: Any) -> None:
    import torch.distributed as dist

    from autopar.comm.collective_check import run_collective

    group = groups.groups[0]
    if rank == 0:
        shard = torch.ones(4096)
        out = torch.empty(2 * 4096)
        run_collective("all_gather", "zero chunk 3", shard, group, "dp",
                       lambda: dist.all_gather_single(out, shard, group=group))  # fmt: skip
    else:
        grad = torch.ones(8, 8192)
        run_collective("all_reduce", "grad bucket 0", grad, group, "dp",
                       lambda: dist.all_reduce(grad, group=group))  # fmt: skip


def _mismatched_autograd_pair(rank: int, groups: Any) -> None:
    from autopar.comm import collectives

    x = torch.ones(2, 3)
    if rank == 0:
        collectives.autopar_all_gather(x, groups.key, 0, 0)
    else:
        collectives.autopar_all_reduce(x, groups.key, 0)


def check_mode_rank(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from autopar.comm import collectives
    from autopar.comm.collective_check import CollectiveMismatchError
    from autopar.comm.process_groups import axis_groups

    groups = axis_groups((2,), ("dp",), key="order-test")
    out: dict[str, Any] = {}
    x = torch.full((2, 3), float(rank + 1))
    y = collectives.autopar_zero_out(x, groups.key, 0)
    out["zero_out_aliases"] = y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    # A matching collective passes the check and computes the same as without it.
    out["matched_sum"] = collectives.autopar_all_reduce(x, groups.key, 0).tolist()
    for name, pair in (("zero", _mismatched_zero_pair), ("autograd", _mismatched_autograd_pair)):
        start = time.perf_counter()
        try:
            pair(rank, groups)
            out[name] = (None, time.perf_counter() - start)
        except CollectiveMismatchError as exc:
            out[name] = (str(exc), time.perf_counter() - start)
        dist.barrier()  # both ranks raised at the check: the groups are in step again
    return out


@pytest.fixture(scope="module")
def check_mode_results() -> list[dict[str, Any]]:
    return run_distributed(check_mode_rank, 2, pg_timeout_s=60, timeout_s=120, env=CHECK_ON)


@pytest.mark.distributed
def test_zero_out_returns_a_new_tensor_on_every_coordinate(
    check_mode_results: list[dict[str, Any]],
) -> None:
    assert [r["zero_out_aliases"] for r in check_mode_results] == [False, False]


@pytest.mark.distributed
def test_matching_collectives_pass_the_check(check_mode_results: list[dict[str, Any]]) -> None:
    for result in check_mode_results:
        assert result["matched_sum"] == [[3.0] * 3] * 2


@pytest.mark.distributed
def test_mismatched_zero_gather_and_grad_reduce_fail_fast_in_one_line(
    check_mode_results: list[dict[str, Any]],
) -> None:
    expected = (
        "collective mismatch on axis dp: rank 0 issued #{n} all_gather(zero chunk 3, 4096 x f32)"
        " while rank 1 issued #{n} all_reduce(grad bucket 0, 8x8192 x f32)"
    )
    for result in check_mode_results:
        message, seconds = result["zero"]
        # The earlier checked collectives on this group: the matched all-reduce (#0).
        assert message == expected.format(n=1), message
        assert seconds < 10, seconds


@pytest.mark.distributed
def test_mismatched_autograd_collectives_fail_fast_in_one_line(
    check_mode_results: list[dict[str, Any]],
) -> None:
    for result in check_mode_results:
        message, seconds = result["autograd"]
        assert message == (
            "collective mismatch on axis dp: rank 0 issued #2 all_gather(tensor, 2x3 x f32) "
            "while rank 1 issued #2 all_reduce(tensor, 2x3 x f32)"
        ), message
        assert seconds < 10, seconds


def missing_peer_rank(rank: int, world_size: int) -> str | None:
    import torch.distributed as dist

    from autopar.comm.collective_check import CollectiveFailedError, run_collective
    from autopar.comm.process_groups import axis_groups

    groups = axis_groups((2,), ("dp",), key="order-timeout")
    group = groups.groups[0]
    message = None
    if rank == 0:
        shard = torch.ones(16)
        out = torch.empty(32)
        try:
            run_collective("all_gather", "zero chunk 0", shard, group, "dp",
                           lambda: dist.all_gather_single(out, shard, group=group))  # fmt: skip
        except CollectiveFailedError as exc:
            message = str(exc)
    else:
        time.sleep(8)  # never joins; outlives rank 0's 3 s timeout
    return message


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["off", "on"])
def test_a_collective_whose_peer_never_comes_names_rank_and_op(check: str) -> None:
    env = CHECK_ON if check == "on" else CHECK_OFF
    start = time.monotonic()
    results = run_distributed(missing_peer_rank, 2, pg_timeout_s=3, timeout_s=60, env=env)
    message = results[0]
    assert message is not None and message.startswith(
        "rank 0: all_gather(zero chunk 0, 16 x f32) on axis dp (group ranks [0, 1]) failed: "
    ), message
    assert "\n" not in message
    assert time.monotonic() - start < 40


def test_pg_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar.runtime.spawn import DEFAULT_PG_TIMEOUT_S, pg_timeout_s

    monkeypatch.delenv("AUTOPAR_PG_TIMEOUT_S", raising=False)
    assert pg_timeout_s() == DEFAULT_PG_TIMEOUT_S == 60.0
    monkeypatch.setenv("AUTOPAR_PG_TIMEOUT_S", "7.5")
    assert pg_timeout_s() == 7.5
    monkeypatch.setenv("AUTOPAR_PG_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="^AUTOPAR_PG_TIMEOUT_S must be a positive number"):
        pg_timeout_s()
