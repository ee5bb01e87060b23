"""Every resharding pair executed for real on gloo matches the in-process simulator.

One spawn per mesh runs every case (see ``tests.distributed.launcher.run_cases``); each test
checks its own case's result. Per pair: the forward output of ``run_steps`` on every rank equals
the simulator's local tensor and assembles to the full tensor in the ``dst`` layout; the gradient
``.backward`` leaves on the input equals the simulator's backward steps and assembles to the
full gradient in the ``src`` gradient layout.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import pytest
import torch

from autopar.comm.collective_check import CHECK_ENV
from autopar.placement import parse_placements
from autopar.resharding.simulator import assemble, shard_full, simulate_steps
from autopar.resharding.steps import gradient_placements, is_supported_pair, reshard_steps
from tests.distributed.launcher import CaseResult, DistributedRunError, run_cases, run_distributed

SHAPE = (4, 4)
PLACEMENTS = ["R", "P", "S0", "S1"]


def full_value() -> torch.Tensor:
    return torch.arange(16, dtype=torch.float64).reshape(SHAPE) - 5.0


def full_grad() -> torch.Tensor:
    return torch.arange(16, dtype=torch.float64).reshape(SHAPE).flip(0) * 3.0 - 7.0


# Section-sharded layouts (dim 1 as two sections of 2: rank r holds column r of each) to and
# from the plain ones below, both ways, and between themselves.
SECTION_LAYOUTS = {1: ["S1[2:2]"], 2: ["S1[2:2],R", "S0,S1[2:2]", "P,S1[2:2]", "R,S1[2:2]"]}
SECTION_PEERS = {1: ["R", "P", "S0", "S1"], 2: ["R,R", "S0,S1", "S1,S0", "P,R", "R,S1", "S0,R"]}


def pairs(mesh_shape: tuple[int, ...]) -> list[tuple[str, tuple[str, str, str]]]:
    layouts = [",".join(p) for p in itertools.product(PLACEMENTS, repeat=len(mesh_shape))]
    sections = SECTION_LAYOUTS[len(mesh_shape)]
    peers = SECTION_PEERS[len(mesh_shape)] + sections
    candidates = [(src, dst) for src in layouts for dst in layouts]
    candidates += [(src, dst) for src in sections for dst in peers]
    candidates += [(src, dst) for src in SECTION_PEERS[len(mesh_shape)] for dst in sections]
    return [
        (f"{src}->{dst}", ("pair", src, dst))
        for src, dst in candidates
        if is_supported_pair(parse_placements(src), parse_placements(dst), SHAPE, mesh_shape)
    ]


def extra_cases() -> list[tuple[str, tuple[str, ...]]]:
    return [
        ("grad_all_reduce", ("grad_all_reduce",)),
        ("fx_graph_calls_collectives_by_key", ("fx",)),
        ("axis_groups_layout", ("layout",)),
        ("ranks_start_warm", ("warm",)),
        ("shard_full_matches_dtensor", ("dtensor",)),
        ("wrong_mesh_size_is_refused", ("wrong_mesh",)),
        ("failing_collective_names_rank_op_axis_shape", ("mismatch",)),
    ]


def _groups(mesh_shape: tuple[int, ...]) -> Any:
    from autopar.comm.process_groups import axis_groups, default_key, lookup_axis_groups

    names = ("dp", "tp", "pp")[: len(mesh_shape)]
    try:
        return lookup_axis_groups(default_key(mesh_shape, names))
    except KeyError:
        return axis_groups(mesh_shape, names)


def run_case(rank: int, world_size: int, case: tuple[str, ...], mesh_shape: tuple[int, ...]) -> Any:
    """Body of one case on one rank; returns what the parent checks."""
    from autopar.comm.collectives import autopar_all_gather, grad_all_reduce, run_steps

    groups = _groups(mesh_shape)
    coord = groups.coordinate
    kind = case[0]
    if kind == "pair":
        src, dst = parse_placements(case[1]), parse_placements(case[2])
        fwd, _ = reshard_steps(src, dst, SHAPE, 8, mesh_shape)
        local = shard_full(full_value(), src, mesh_shape, seed=3)[coord].requires_grad_(True)
        out = run_steps(local, fwd, groups)
        grad_out = shard_full(full_grad(), gradient_placements(dst), mesh_shape)[coord]
        out.backward(grad_out)
        assert local.grad is not None
        return coord, out.detach(), local.grad
    if kind == "grad_all_reduce":
        x = torch.full((2, 3), float(rank), dtype=torch.float64, requires_grad=True)
        y = grad_all_reduce(x, groups.key, tuple(range(len(mesh_shape))))
        assert torch.equal(y, x)
        y.backward(torch.full((2, 3), rank + 1.0, dtype=torch.float64))
        return x.grad
    if kind == "fx":
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(autopar_all_gather, (x, groups.key, 0, 1)))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        return gm.code, gm(torch.full((2, 1), float(coord[0])))
    if kind == "layout":
        return coord, tuple(groups.ranks_of_axis(a) for a in range(len(mesh_shape)))
    if kind == "warm":
        import sys

        warm = sys.modules.get("tests.distributed.warm_ranks")
        return None if warm is None else warm.WARM_CPU_S
    if kind == "dtensor":
        from torch.distributed.tensor import distribute_tensor

        # The simulator's chunk order (axis 0 outermost) is DTensor's, for every R/S layout.
        full = torch.arange(16.0).reshape(SHAPE)
        for layout in itertools.product(["R", "S0", "S1"], repeat=len(mesh_shape)):
            placements = parse_placements(",".join(layout))
            local = distribute_tensor(full, groups.device_mesh, placements).to_local()
            assert torch.equal(local, shard_full(full, placements, mesh_shape)[coord]), layout
        return True
    if kind == "wrong_mesh":
        from autopar.comm.process_groups import axis_groups

        try:
            axis_groups((2, world_size * 2), ("a", "b"))
        except ValueError as error:
            return str(error)
        raise AssertionError("axis_groups accepted a mesh larger than the world")
    if kind == "mismatch":
        from autopar.comm.collectives import AllGather

        # Rank 0 sends (1, 3), the others (2, 3): a failing all_gather on axis 0 (the
        # shape check of TORCH_DISTRIBUTED_DEBUG=DETAIL catches it on every rank). The launcher's
        # autopar check mode would refuse it before gloo runs it; this case tests the failure.
        t = torch.zeros((1 if coord[0] == 0 else 2, 3))
        os.environ[CHECK_ENV] = "0"
        try:
            AllGather.apply(t, groups, 0, 0)
        except RuntimeError as error:
            return str(error)
        finally:
            os.environ[CHECK_ENV] = "1"
        return None
    raise AssertionError(f"unknown case {case}")


def expected_pair(src_text: str, dst_text: str, mesh_shape: tuple[int, ...]) -> tuple[dict, dict]:
    src, dst = parse_placements(src_text), parse_placements(dst_text)
    fwd, bwd = reshard_steps(src, dst, SHAPE, 8, mesh_shape)
    out = simulate_steps(shard_full(full_value(), src, mesh_shape, seed=3), fwd, mesh_shape)
    grad_out = shard_full(full_grad(), gradient_placements(dst), mesh_shape)
    return out, simulate_steps(grad_out, bwd, mesh_shape)


def check_pair(result: CaseResult, mesh_shape: tuple[int, ...]) -> None:
    _, src_text, dst_text = next(c for n, c in pairs(mesh_shape) if n == result.name)
    values = result.check()
    outs = {coord: out for coord, out, _ in values}
    grads = {coord: grad for coord, _, grad in values}
    want_out, want_grads = expected_pair(src_text, dst_text, mesh_shape)
    for coord in want_out:
        torch.testing.assert_close(outs[coord], want_out[coord], rtol=0, atol=0)
        torch.testing.assert_close(grads[coord], want_grads[coord], rtol=0, atol=0)
    src, dst = parse_placements(src_text), parse_placements(dst_text)
    torch.testing.assert_close(assemble(outs, dst, mesh_shape), full_value(), rtol=0, atol=0)
    torch.testing.assert_close(
        assemble(grads, gradient_placements(src), mesh_shape), full_grad(), rtol=0, atol=0
    )


MESHES = {"mesh2": (2,), "mesh2x2": (2, 2)}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, CaseResult]]:
    """Every case of every mesh, one spawn per mesh (run once for the module)."""
    out = {}
    for mesh_name, mesh_shape in MESHES.items():
        cases = pairs(mesh_shape) + extra_cases()
        world_size = 1
        for size in mesh_shape:
            world_size *= size
        out[mesh_name] = run_cases(
            run_case, world_size, cases, mesh_shape, timeout_s=120, pg_timeout_s=20
        )
    return out


PAIR_PARAMS = [
    pytest.param(mesh_name, name, id=f"{mesh_name}:{name}")
    for mesh_name, mesh_shape in MESHES.items()
    for name, _ in pairs(mesh_shape)
]


@pytest.mark.distributed
@pytest.mark.parametrize(("mesh_name", "name"), PAIR_PARAMS)
def test_resharding_pair_matches_simulator_forward_and_backward(
    results: dict[str, dict[str, CaseResult]], mesh_name: str, name: str
) -> None:
    check_pair(results[mesh_name][name], MESHES[mesh_name])


@pytest.mark.distributed
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_grad_all_reduce_is_identity_forward_and_sums_gradients(
    results: dict[str, dict[str, CaseResult]], mesh_name: str
) -> None:
    grads = results[mesh_name]["grad_all_reduce"].check()
    world_size = len(grads)
    total = sum(float(r + 1) for r in range(world_size))
    for grad in grads:
        torch.testing.assert_close(grad, torch.full((2, 3), total, dtype=torch.float64))


@pytest.mark.distributed
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_fx_graph_calls_collectives_by_group_key(
    results: dict[str, dict[str, CaseResult]], mesh_name: str
) -> None:
    for code, out in results[mesh_name]["fx_graph_calls_collectives_by_key"].check():
        assert "autopar_all_gather" in code
        torch.testing.assert_close(out, torch.tensor([[0.0, 1.0], [0.0, 1.0]]))


@pytest.mark.distributed
def test_axis_groups_are_rank_major(results: dict[str, dict[str, CaseResult]]) -> None:
    layout = results["mesh2x2"]["axis_groups_layout"].check()
    assert layout == (
        ((0, 0), ((0, 2), (0, 1))),
        ((0, 1), ((1, 3), (0, 1))),
        ((1, 0), ((0, 2), (2, 3))),
        ((1, 1), ((1, 3), (2, 3))),
    )


@pytest.mark.distributed
def test_ranks_are_forked_from_the_warmed_forkserver(
    results: dict[str, dict[str, CaseResult]],
) -> None:
    """The launcher's forkserver ran tests/distributed/warm_ranks.py (a capture and a plan)
    before forking the ranks: a broken warm-up would only make every spawn ~2 s per rank
    slower, silently, so it is asserted here."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no forkserver on this platform: ranks are spawned cold")
    for values in (results[name]["ranks_start_warm"].check() for name in MESHES):
        assert all(isinstance(v, float) and v > 0 for v in values), values


@pytest.mark.distributed
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_simulator_chunk_order_matches_dtensor(
    results: dict[str, dict[str, CaseResult]], mesh_name: str
) -> None:
    results[mesh_name]["shard_full_matches_dtensor"].check()


@pytest.mark.distributed
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_mesh_larger_than_world_is_refused_naming_both(
    results: dict[str, dict[str, CaseResult]], mesh_name: str
) -> None:
    world_size = len(results[mesh_name]["wrong_mesh_size_is_refused"].values)
    for message in results[mesh_name]["wrong_mesh_size_is_refused"].check():
        assert message == (
            f"mesh (2, {2 * world_size}) has {4 * world_size} devices "
            f"but the world size is {world_size}"
        )


@pytest.mark.distributed
def test_failing_collective_names_rank_op_axis_group_and_shape(
    results: dict[str, dict[str, CaseResult]],
) -> None:
    messages = results["mesh2"]["failing_collective_names_rank_op_axis_shape"].check()
    assert messages[0] is not None and messages[0].startswith(
        "rank 0: all_gather over axis 'dp' (group ranks [0, 1]) of shape (1, 3) failed: "
    )
    assert messages[1] is not None and messages[1].startswith(
        "rank 1: all_gather over axis 'dp' (group ranks [0, 1]) of shape (2, 3) failed: "
    )


def fail_on_rank_one(rank: int, world_size: int, message: str) -> int:
    if rank == 1:
        raise ValueError(message)
    time.sleep(600)  # rank 0 hangs: the launcher must kill it after the grace period
    return rank


def case_failing_on_rank_one(rank: int, world_size: int, case: str) -> str:
    if case == "bad" and rank == 1:
        raise ValueError("bad case on rank 1")
    return f"{case} on {rank}"


@pytest.mark.distributed
def test_launcher_reports_a_failing_rank_and_kills_the_waiting_one() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(fail_on_rank_one, 2, "boom from rank 1", timeout_s=60, grace_s=1.0)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 1: Traceback" in message and "ValueError: boom from rank 1" in message
    assert "ranks [0]: killed after another rank failed" in message


@pytest.mark.distributed
def test_run_cases_records_a_failing_case_and_skips_the_rest() -> None:
    results = run_cases(
        case_failing_on_rank_one, 2, [("good", "good"), ("bad", "bad"), ("later", "later")]
    )
    assert results["good"].check() == ("good on 0", "good on 1")
    assert results["bad"].errors[0] is None
    assert "ValueError: bad case on rank 1" in (results["bad"].errors[1] or "")
    with pytest.raises(AssertionError, match="skipped: case 'bad' failed on ranks \\[1\\]"):
        results["later"].check()


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(600)


@pytest.mark.distributed
def test_launcher_kills_every_rank_at_the_overall_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(
        DistributedRunError, match=r"ranks \[0, 1\]: still running at the 2 s timeout"
    ):
        run_distributed(sleep_forever, 2, timeout_s=2)
    assert time.monotonic() - start < 20
