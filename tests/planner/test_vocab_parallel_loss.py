"""The vocab-parallel cross entropy in the planner: what it costs and when it is offered.

Numerics of the strategy (every reduction, ignored targets, label smoothing, spatial dims, meshes
2 and 2x2) are checked on gloo ranks by ``tests/distributed/test_conformance.py`` through the
lowering's substitution; whole models under the megatron recipe by ``test_end_to_end.py``.
"""

from __future__ import annotations

import torch

from autopar.placement import REPLICATE, Shard
from autopar.strategies.registry import expand, get_rule
from cost_models import collective_time_s
from tests.strategy_oracle import call_from_args

aten = torch.ops.aten


def test_vocab_parallel_loss_is_priced_as_one_all_gather_of_per_sample_stats() -> None:
    """On 2 ranks the class-sharded cross entropy costs one all-gather of 3 [N] vectors per
    rank (in the node's activation-collective time), keeps half the softmax, and takes
    class-sharded logits without a conversion, where the replicated loss pays their gather."""
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.planner.space import build_space
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    mesh = Mesh.spec((2,), ("tp",), device="h100")
    space = build_space(captured, mesh, PlanOptions(optimizer="sgd"))
    loss_node = next(
        n for n in captured.gm.graph.nodes if n.target is aten.cross_entropy_loss.default
    )
    logits = loss_node.args[0].meta["val"]
    num_samples, num_classes = logits.shape
    loss = space.node(loss_node.name)
    by_input = {s.inputs[0]: i for i, s in enumerate(loss.strategies)}
    sharded, replicated = by_input[(Shard(1),)], by_input[(REPLICATE,)]
    assert loss.strategies[sharded].outputs == ((REPLICATE,),)

    stats_bytes = 3 * num_samples * 4  # max, sum of exponentials, target logit; fp32
    want = collective_time_s("all_gather", 2 * stats_bytes, 2, mesh.links[0])
    assert loss.grad_comm_s[sharded] == want
    assert loss.grad_comm_s[replicated] == 0.0
    assert loss.activation_bytes[sharded] == loss.activation_bytes[replicated] / 2

    edge = next(
        e for e in space.edges if e.dst == space.index[loss_node.name] and e.input_index == 0
    )
    producer = space.nodes[edge.src]
    from_sharded = next(i for i, s in enumerate(producer.strategies) if s.outputs[0] == (Shard(1),))
    gather_s = edge.cost_s[from_sharded, replicated]
    assert edge.cost_s[from_sharded, sharded] == 0.0
    assert gather_s > loss.grad_comm_s[sharded]
    assert num_samples * num_classes * 4 > 2 * stats_bytes


def _class_sharded(op_args: tuple, mesh_shape: tuple[int, ...] = (2,)) -> list[str]:
    call = call_from_args(aten.cross_entropy_loss.default, op_args, {})
    rule = get_rule(aten.cross_entropy_loss.default)
    strategies = expand(call, rule(call), mesh_shape)
    return [s.describe() for s in strategies if any(p == Shard(1) for p in s.inputs[0])]


def test_class_dim_is_sharded_only_for_unweighted_class_index_targets() -> None:
    logits = torch.randn(8, 4, dtype=torch.float64)
    targets = torch.randint(0, 4, (8,))
    assert _class_sharded((logits, targets)) == ["[S1 R] -> [R]"]  # mean: Replicate output
    assert _class_sharded((logits, targets, None, 0, -100, 0.1)) == ["[S1 R] -> [R]"]
    assert "[S0,S1 S0,R] -> [P,R]" in _class_sharded((logits, targets, None, 2), (2, 2))
    # Class weights and class-probability targets keep the replicated class dim.
    assert _class_sharded((logits, targets, torch.rand(4, dtype=torch.float64), 2)) == []
    assert _class_sharded((logits, logits.softmax(-1), None, 2)) == []
