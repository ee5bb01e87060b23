"""A model captured by layer replication (3 of 8 layers traced) trains on 2 gloo ranks exactly
like one process: the lowering and runtime get the same graph a full export gives."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.reference import assert_close_named, sgd_reference, sgd_steps

RTOL, ATOL = 1e-5, 1e-6
NUM_LAYERS = 8
LR = 0.1


def train_replicated_llama(rank: int, world_size: int) -> dict[str, Any]:
    import autopar
    from autopar.capture.export import capture
    from autopar.runtime.module import gather_full
    from tests.models import tiny_llama

    model, args, kwargs = tiny_llama(layers=NUM_LAYERS)
    assert capture(model, args, kwargs).replicated_layers == f"layers: 3 of {NUM_LAYERS} traced"
    want = sgd_reference(*tiny_llama(layers=NUM_LAYERS), lr=LR, steps=3)
    mesh = autopar.Mesh.from_world((world_size,), device="h100")
    pmodel = autopar.autoparallelize(
        model, mesh, args, kwargs, recipe="megatron", optimizer="sgd", price_baselines=False
    )
    layouts = set(pmodel.plan.param_placements().values())
    assert any("S" in p for p in layouts), layouts
    local_args = pmodel.shard_inputs(*args)
    loss = pmodel(*local_args)
    assert_close_named("loss", loss.detach(), want["loss"], rtol=RTOL, atol=ATOL)
    loss.backward()
    group_of = pmodel.groups.groups.__getitem__
    for name, param in pmodel.named_parameters():
        grad = gather_full(param.grad, pmodel.lowered.param_placements[name], group_of)
        assert_close_named(f"grad of {name}", grad, want["grads"][name], rtol=RTOL, atol=ATOL)
    sgd_steps(pmodel, local_args, {}, lr=LR, steps=3)
    state = pmodel.state_dict()
    for name, param in want["params"].items():
        assert_close_named(name, state[name], param.detach(), rtol=RTOL, atol=ATOL)
    return {"num_params": len(want["params"])}


@pytest.mark.distributed
@pytest.mark.slow
def test_replicated_capture_trains_like_one_process_under_megatron_on_two_ranks() -> None:
    results = run_distributed(train_replicated_llama, 2, timeout_s=300.0)
    assert results[0]["num_params"] == 3 + 9 * NUM_LAYERS  # embedding, norm, output; 9 a layer
