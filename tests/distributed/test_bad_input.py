"""Bad input to autoparallelize on real gloo ranks fails fast, with messages that say what to fix.

* a mesh whose size is not the world size: the error names both sizes;
* local inputs whose shapes differ from the planned local shapes: the error names both shapes;
* a plan made for another model, or for another mesh shape: refused on every rank;
* a rank that dies (``os._exit``) or stalls before a collective of the forward: the other rank's
  collective raises within the configured timeout (``timeout_s=``), naming its rank, the op and
  the mesh axis, instead of hanging.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 3.0
"""The collective timeout given to autoparallelize in the stalled-rank case."""


def _raises(exc_type: type[BaseException], call: Any) -> str:
    with pytest.raises(exc_type) as info:
        call()
    return str(info.value)


def bad_input_case(rank: int, world_size: int, case: str, plan_paths: dict[str, str]) -> Any:
    import autopar
    from tests.models import tiny_gpt, tiny_mlp

    if case == "world_size":
        return [
            _raises(ValueError, lambda: autopar.Mesh.from_world((3,))),
            _raises(ValueError, lambda: autopar.Mesh.from_world((2, 2))),
        ]
    mesh = autopar.Mesh.from_world((2,), device="h100")
    if case == "input_shapes":
        model, (x, y), _ = tiny_mlp()
        pmodel = autopar.autoparallelize(model, mesh, (x, y), recipe="ddp")
        return _raises(ValueError, lambda: pmodel(x, y))
    if case == "plan_for_another_model":
        model, args, kwargs = tiny_gpt()
        return _raises(
            autopar.PlanMismatchError,
            lambda: autopar.autoparallelize(model, mesh, args, kwargs, plan=plan_paths["mlp2"]),
        )
    if case == "plan_for_another_mesh":
        model, args, kwargs = tiny_mlp()
        return _raises(
            autopar.PlanMismatchError,
            lambda: autopar.autoparallelize(model, mesh, args, kwargs, plan=plan_paths["mlp4"]),
        )
    raise AssertionError(case)


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import autopar
    from tests.distributed.launcher import run_cases
    from tests.models import tiny_mlp

    folder = tmp_path_factory.mktemp("plans")
    plan_paths = {}
    for name, shape in (("mlp2", (2,)), ("mlp4", (4,))):
        model, args, kwargs = tiny_mlp()
        path = folder / f"{name}.json"
        autopar.plan(model, autopar.Mesh.spec(shape), args, kwargs, recipe="ddp").save(path)
        plan_paths[name] = str(path)
    cases = ["world_size", "input_shapes", "plan_for_another_model", "plan_for_another_mesh"]
    return run_cases(
        bad_input_case, 2, [(c, c) for c in cases], plan_paths, timeout_s=120, pg_timeout_s=20
    )


def test_mesh_of_another_size_names_both_sizes(bad_input_results: dict[str, Any]) -> None:
    for three, four in bad_input_results["world_size"].check():
        assert "(3,)" in three and "3 devices" in three and "world size is 2" in three
        assert "(2, 2)" in four and "4 devices" in four and "world size is 2" in four


def test_inputs_of_other_shapes_name_both_shapes(bad_input_results: dict[str, Any]) -> None:
    for message in bad_input_results["input_shapes"].check():
        assert "(8, 64)" in message and "(4, 64)" in message and "shard_inputs" in message


def test_plan_for_another_model_is_refused_on_every_rank(
    bad_input_results: dict[str, Any],
) -> None:
    messages = bad_input_results["plan_for_another_model"].check()
    assert len(messages) == 2
    for rank, message in enumerate(messages):
        assert f"rank {rank}" in message and "another model" in message


def test_plan_for_another_mesh_is_refused_on_every_rank(
    bad_input_results: dict[str, Any],
) -> None:
    for message in bad_input_results["plan_for_another_mesh"].check():
        assert "(4,)" in message and "(2,)" in message


# --------------------------------------------------------------------------------------------
# A rank that dies or stalls


def lost_rank(rank: int, world_size: int, how: str, out_dir: str) -> Any:
    """Rank 1 dies (``os._exit``) or stalls before the forward; rank 0 runs the forward and
    records the error it gets and how long it took."""
    import autopar
    from tests.models import tiny_mlp

    mesh = autopar.Mesh.from_world((2,), device="h100")
    model, (x, y), _ = tiny_mlp()
    # Megatron on one axis: the forward all-reduces the row-parallel output.
    pmodel = autopar.autoparallelize(model, mesh, (x, y), recipe="megatron", timeout_s=TIMEOUT_S)
    local = pmodel.shard_inputs(x, y)
    if rank == 1:
        if how == "dies":
            os._exit(3)
        time.sleep(TIMEOUT_S + 4)
        return "stalled"
    start = time.perf_counter()
    try:
        pmodel(*local)
    except RuntimeError as exc:
        record = {"error": str(exc), "seconds": time.perf_counter() - start}
    else:
        record = {"error": None, "seconds": time.perf_counter() - start}
    Path(out_dir, f"{how}.json").write_text(json.dumps(record))
    return record


def _check_lost_rank_error(record: dict[str, Any]) -> None:
    assert record["error"] is not None, "the forward must fail when a peer is gone"
    assert re.search(r"rank 0: \w+ over axis 'a0' \(group ranks \[0, 1\]\)", record["error"]), (
        record
    )
    assert record["seconds"] < TIMEOUT_S + 5, record


# Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks each collective with a barrier on a helper
# group whose timeout is the world's (fixed at creation), so these runs use the plain backend.
PLAIN = {"TORCH_DISTRIBUTED_DEBUG": "OFF"}


def test_rank_that_stalls_makes_the_others_time_out_naming_op_and_rank(tmp_path: Path) -> None:
    from tests.distributed.launcher import run_distributed

    results = run_distributed(
        lost_rank, 2, "stalls", str(tmp_path), timeout_s=60, pg_timeout_s=30, env=PLAIN
    )
    assert results[1] == "stalled"
    _check_lost_rank_error(results[0])
    assert "imed out" in results[0]["error"] or "timeout" in results[0]["error"].lower()


def test_rank_that_dies_makes_the_others_fail_naming_op_and_rank(tmp_path: Path) -> None:
    from tests.distributed.launcher import DistributedRunError, run_distributed

    with pytest.raises(DistributedRunError, match="rank 1: exited with code 3"):
        run_distributed(
            lost_rank,
            2,
            "dies",
            str(tmp_path),
            timeout_s=60,
            pg_timeout_s=30,
            grace_s=20,
            env=PLAIN,
        )
    record = json.loads((tmp_path / "dies.json").read_text())
    _check_lost_rank_error(record)


def test_from_world_outside_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import autopar

    if dist.is_initialized():
        pytest.skip("needs a process without a process group")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        autopar.Mesh.from_world((2,))


def test_mesh_groups_are_not_part_of_its_identity() -> None:
    import dataclasses

    import autopar

    mesh = autopar.Mesh.spec((2, 2))
    live = dataclasses.replace(mesh, groups=object())
    assert live == mesh and hash(live) == hash(mesh)
    assert live.to_dict() == mesh.to_dict()
    assert "groups" not in repr(live)
