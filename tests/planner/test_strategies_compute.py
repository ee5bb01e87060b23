"""Compute rules (matmul family, pointwise, reductions, norms, losses) against the oracle.

Every case expands the registered rule on a (2,) and a (2, 2) mesh, simulates every strategy
numerically (forward and gradients) and compares its output placements with DTensor's. The
allow-lists below say, per op, why some of our strategies differ from DTensor's choice.
"""

from __future__ import annotations

import pytest
import torch

import autopar.strategies  # noqa: F401  (registers every rule)
from autopar.placement import parse_placements
from autopar.strategies.registry import Strategy, get_rule, strategies_for
from tests.strategy_oracle import check_rule, dtensor_output_placements, simulate

aten = torch.ops.aten
F64 = torch.float64


torch.manual_seed(0)  # the cases below draw their inputs at import time


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64)


# Allow-list keys (see tests/strategy_oracle.check_rule): "re:<regex>" over Strategy.describe().
PARTIAL_INPUT = r"re:^\[[^\]]*P"  # some input is Partial
PARTIAL_OUTPUT = r"re:-> \[.*P"  # some output is Partial
PARTIAL_IN_LINEAR_OP = (
    "DTensor redistributes a Partial input of this op although the op is linear in it; ours keeps "
    "it Partial (exact: checked by the numeric simulation)"
)
PARTIAL_BIAS = (
    "DTensor adds the bias of a Partial product only after redistributing; ours takes the bias "
    "Partial too (added once over the axis), checked numerically"
)
FLATTENED_BATCH = (
    "DTensor runs this op through its decomposition, which views the batch dims as one; that view "
    "cannot keep a non-leading batch dim split, or a dim split over both mesh axes, without a "
    "redistribution. Ours never reshapes, checked numerically"
)
BROADCAST_BATCH = (
    "DTensor decomposes a batch-broadcasting matmul into expand + reshape + bmm and redistributes "
    "for every sharded layout; ours keeps every layout local, checked numerically"
)
# Composite ops (linear, matmul, einsum) go through DTensor's redistribution planner on views,
# about a second per strategy on a 2x2 mesh: their DTensor comparison runs on the (2,) mesh
# (and on (2, 2) for the 2-D/3-D cases), the numeric simulation on both.
ONE_D = ((2,),)
BOTH = ((2,), (2, 2))

# --------------------------------------------------------------------------------------------
# Matmul family

MATMUL_CASES = [
    pytest.param(aten.mm.default, (rand(4, 8), rand(8, 6)), {}, {}, BOTH, id="mm"),
    pytest.param(aten.bmm.default, (rand(2, 4, 8), rand(2, 8, 6)), {}, {}, BOTH, id="bmm"),
    pytest.param(
        aten.addmm.default,
        (rand(6), rand(4, 8), rand(8, 6)),
        {},
        {PARTIAL_OUTPUT: PARTIAL_BIAS},
        BOTH,
        id="addmm-1d-bias",
    ),
    pytest.param(
        aten.addmm.default,
        (rand(4, 6), rand(4, 8), rand(8, 6)),
        {},
        {PARTIAL_OUTPUT: PARTIAL_BIAS},
        BOTH,
        id="addmm-2d-bias",
    ),
    pytest.param(
        aten.baddbmm.default,
        (rand(2, 4, 6), rand(2, 4, 8), rand(2, 8, 6)),
        {},
        {PARTIAL_OUTPUT: PARTIAL_BIAS},
        BOTH,
        id="baddbmm",
    ),
    pytest.param(aten.linear.default, (rand(4, 8), rand(6, 8)), {}, {}, BOTH, id="linear-2d"),
    pytest.param(
        aten.linear.default,
        (rand(2, 4, 8), rand(6, 8), rand(6)),
        {},
        {PARTIAL_OUTPUT: PARTIAL_BIAS, "re:^\\[S1,S1": FLATTENED_BATCH},
        BOTH,
        id="linear-3d-bias",
    ),
    pytest.param(
        aten.linear.default, (rand(2, 2, 4, 8), rand(6, 8)), {}, {}, ONE_D, id="linear-4d"
    ),
    pytest.param(
        aten.matmul.default, (rand(2, 2, 4, 8), rand(2, 2, 8, 6)), {}, {}, ONE_D, id="matmul-4d"
    ),
    pytest.param(
        aten.matmul.default,
        (rand(2, 4, 8), rand(8, 6)),
        {},
        {"re:^\\[S1,S1": FLATTENED_BATCH},
        BOTH,
        id="matmul-3d-2d",
    ),
    pytest.param(
        aten.matmul.default,
        (rand(2, 1, 4, 8), rand(2, 8, 6)),
        {},
        {"*": BROADCAST_BATCH},
        (),
        id="matmul-broadcast-batch",
    ),
    pytest.param(aten.matmul.default, (rand(4, 8), rand(8)), {}, {}, BOTH, id="matmul-mv"),
    pytest.param(
        aten.matmul.default,
        (rand(8), rand(2, 8, 6)),
        {},
        {"*": FLATTENED_BATCH},
        ONE_D,
        id="matmul-vec-batched",
    ),
    pytest.param(
        aten.einsum.default,
        ("bhqd,bhkd->bhqk", [rand(2, 2, 4, 8), rand(2, 2, 4, 8)]),
        {},
        {},
        ONE_D,
        id="einsum",
    ),
    pytest.param(
        aten.einsum.default,
        ("...ij,jk", [rand(2, 4, 8), rand(8, 6)]),
        {},
        {"re:^\\[S1,S1": FLATTENED_BATCH},
        BOTH,
        id="einsum-ellipsis",
    ),
]


@pytest.mark.parametrize("op,args,kwargs,differs,dtensor_meshes", MATMUL_CASES)
def test_matmul_family_matches_oracle(op, args, kwargs, differs, dtensor_meshes) -> None:
    check_rule(op, args, kwargs, dtensor_differs=differs, dtensor_mesh_shapes=dtensor_meshes)


def test_linear_has_megatron_column_and_row_strategies() -> None:
    strategies = check_rule(
        aten.linear.default,
        (rand(4, 8), rand(6, 8), rand(6)),
        {},
        mesh_shapes=((2,),),
        dtensor_differs={PARTIAL_OUTPUT: PARTIAL_BIAS},
    )
    described = {s.describe() for s in strategies}
    assert "[R S0 S0] -> [S1]" in described  # column parallel: weight rows, bias split
    assert "[S1 S1 P] -> [P]" in described  # row parallel: contraction split, Partial out
    assert "[S0 R R] -> [S0]" in described  # data parallel


# --------------------------------------------------------------------------------------------
# Pointwise


def _mask(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) > 0.5


POINTWISE_CASES = [
    pytest.param(aten.add.Tensor, (rand(4, 6), rand(4, 6)), {}, id="add"),
    pytest.param(aten.add.Tensor, (rand(2, 4, 6), rand(6)), {}, id="add-broadcast-bias"),
    pytest.param(aten.add.Tensor, (rand(2, 1, 6), rand(4, 1)), {}, id="add-broadcast-both"),
    pytest.param(aten.add.Tensor, (rand(4, 6), 2.0), {}, id="add-scalar"),
    pytest.param(aten.add.Tensor, (rand(4, 6), rand(4, 6)), {"alpha": 0.5}, id="add-alpha"),
    pytest.param(aten.add_.Tensor, (rand(4, 6), rand(4, 6)), {}, id="add-inplace"),
    pytest.param(aten.sub.Tensor, (rand(4, 6), rand(4, 6)), {}, id="sub"),
    pytest.param(aten.rsub.Scalar, (rand(4, 6), 1.0), {}, id="rsub-scalar"),
    pytest.param(aten.mul.Tensor, (rand(2, 4, 6), rand(4, 6)), {}, id="mul"),
    pytest.param(aten.mul.Tensor, (rand(4, 6), torch.tensor(3.0, dtype=F64)), {}, id="mul-0d"),
    pytest.param(aten.mul.Scalar, (rand(4, 6), 3.0), {}, id="mul-scalar"),
    pytest.param(aten.div.Tensor, (rand(4, 6), rand(4, 1) + 3), {}, id="div"),
    pytest.param(aten.div.Scalar, (rand(4, 6), 3.0), {}, id="div-scalar"),
    pytest.param(aten.neg.default, (rand(4, 6),), {}, id="neg"),
    pytest.param(aten.pow.Tensor_Scalar, (rand(4, 6), 2), {}, id="pow"),
    pytest.param(aten.rsqrt.default, (rand(4, 6).abs() + 1,), {}, id="rsqrt"),
    pytest.param(aten.sqrt.default, (rand(4, 6).abs() + 1,), {}, id="sqrt"),
    pytest.param(aten.exp.default, (rand(4, 6),), {}, id="exp"),
    pytest.param(aten.log.default, (rand(4, 6).abs() + 1,), {}, id="log"),
    pytest.param(aten.tanh.default, (rand(4, 6),), {}, id="tanh"),
    pytest.param(aten.cos.default, (rand(4, 6),), {}, id="cos"),
    pytest.param(aten.sin.default, (rand(4, 6),), {}, id="sin"),
    pytest.param(aten.gelu.default, (rand(2, 4, 6),), {"approximate": "tanh"}, id="gelu"),
    pytest.param(aten.silu.default, (rand(4, 6),), {}, id="silu"),
    pytest.param(aten.relu.default, (rand(4, 6),), {}, id="relu"),
    pytest.param(aten.sigmoid.default, (rand(4, 6),), {}, id="sigmoid"),
    pytest.param(aten.where.self, (_mask(4, 1), rand(4, 6), rand(6)), {}, id="where"),
    pytest.param(
        aten.masked_fill.Scalar, (rand(2, 4, 6), _mask(4, 6), 0.0), {}, id="masked_fill-zero"
    ),
    pytest.param(aten.masked_fill.Scalar, (rand(2, 4, 6), _mask(4, 6), -1e9), {}, id="masked_fill"),
    pytest.param(
        aten.eq.Tensor,
        (torch.randint(0, 3, (2, 1, 4, 1)), torch.randint(0, 3, (2, 1, 1, 4))),
        {},
        id="eq-broadcast",
    ),
    pytest.param(aten.le.Tensor, (rand(4, 6), rand(4, 6)), {}, id="le"),
    pytest.param(aten.ne.Scalar, (torch.randint(0, 3, (4, 6)), 1), {}, id="ne-scalar"),
    pytest.param(aten.lt.Scalar, (rand(4, 6), 0.0), {}, id="lt-scalar"),
    pytest.param(aten.__and__.Tensor, (torch.tensor(True), _mask(2, 1, 4, 4)), {}, id="and-0d"),
    pytest.param(aten.logical_not.default, (_mask(4, 6),), {}, id="logical_not"),
    pytest.param(aten.clamp.default, (rand(4, 6),), {"min": -0.5, "max": 0.5}, id="clamp"),
    pytest.param(aten.to.dtype, (rand(4, 6), torch.float32), {}, id="to-dtype"),
    pytest.param(aten.to.dtype, (rand(4, 6), torch.int64), {}, id="to-int"),
    pytest.param(
        aten.to.dtype_layout,
        (rand(4, 6),),
        {"dtype": torch.float32, "layout": torch.strided, "device": torch.device("cpu")},
        id="to-dtype-layout",
    ),
    pytest.param(aten._to_copy.default, (rand(4, 6),), {"dtype": torch.float32}, id="_to_copy"),
    pytest.param(aten.type_as.default, (rand(4, 6).float(), rand(4, 6)), {}, id="type_as"),
    pytest.param(aten.clone.default, (rand(4, 6),), {}, id="clone"),
    pytest.param(aten.zeros_like.default, (rand(4, 6),), {}, id="zeros_like"),
    pytest.param(aten.fill.Scalar, (rand(4, 6), 2.0), {}, id="fill"),
]

# Why some pointwise strategies of ours differ from DTensor's (per op id).
POINTWISE_DIFFERS: dict[str, dict[str, str]] = {
    "where": {PARTIAL_INPUT: PARTIAL_IN_LINEAR_OP + " (both values Partial, condition Replicate)"},
    "masked_fill-zero": {PARTIAL_INPUT: PARTIAL_IN_LINEAR_OP + " (fill value 0)"},
    "clone": {PARTIAL_INPUT: PARTIAL_IN_LINEAR_OP},
}


@pytest.mark.parametrize("op,args,kwargs", POINTWISE_CASES)
def test_pointwise_matches_oracle(op, args, kwargs, request) -> None:
    case = request.node.callspec.id
    check_rule(op, args, kwargs, dtensor_differs=POINTWISE_DIFFERS.get(case))


# --------------------------------------------------------------------------------------------
# Reductions and scans

REDUCTION_CASES = [
    pytest.param(aten.sum.default, (rand(4, 6),), {}, id="sum-all"),
    pytest.param(aten.sum.dim_IntList, (rand(2, 4, 6), [-1]), {}, id="sum-last"),
    pytest.param(aten.sum.dim_IntList, (rand(2, 4, 6), [0, 2], True), {}, id="sum-keepdim"),
    pytest.param(aten.mean.default, (rand(4, 6),), {}, id="mean-all"),
    pytest.param(aten.mean.dim, (rand(2, 4, 6), [-1], True), {}, id="mean-keepdim"),
    pytest.param(aten.mean.dim, (rand(2, 4, 6), [1]), {}, id="mean-middle"),
    pytest.param(aten.amax.default, (rand(2, 4, 6), [1]), {}, id="amax"),
    pytest.param(aten.amin.default, (rand(2, 4, 6), [-1], True), {}, id="amin"),
    pytest.param(aten.max.dim, (rand(2, 4, 6), 1), {}, id="max-dim"),
    pytest.param(aten.min.dim, (rand(2, 4, 6), -1, True), {}, id="min-dim"),
    pytest.param(
        aten.var.correction, (rand(2, 4, 6), [2]), {"correction": 1, "keepdim": True}, id="var"
    ),
    pytest.param(aten.std.correction, (rand(2, 4, 6), [0]), {"correction": 0}, id="std"),
    pytest.param(aten.cumsum.default, (rand(4, 6), -1), {}, id="cumsum"),
    pytest.param(
        aten.diff.default,
        (torch.randint(0, 5, (4, 6)), 1, -1, torch.randint(0, 5, (4, 1))),
        {},
        id="diff-prepend",
    ),
    pytest.param(aten.diff.default, (rand(4, 6), 1, 0), {}, id="diff"),
]

MEAN_OF_PARTIAL = {
    PARTIAL_INPUT: PARTIAL_IN_LINEAR_OP + " (mean of a Partial is the Partial of the means)"
}
REDUCTION_DIFFERS: dict[str, dict[str, str]] = {
    "mean-all": MEAN_OF_PARTIAL,
    "mean-keepdim": MEAN_OF_PARTIAL,
    "mean-middle": MEAN_OF_PARTIAL,
    "cumsum": {PARTIAL_INPUT: PARTIAL_IN_LINEAR_OP},
}


@pytest.mark.parametrize("op,args,kwargs", REDUCTION_CASES)
def test_reductions_match_oracle(op, args, kwargs, request) -> None:
    case = request.node.callspec.id
    check_rule(op, args, kwargs, dtensor_differs=REDUCTION_DIFFERS.get(case))


def test_mean_never_takes_a_sharded_reduced_dim() -> None:
    strategies = check_rule(
        aten.mean.dim,
        (rand(2, 4, 6), [-1]),
        {},
        mesh_shapes=((2,),),
        dtensor_differs=REDUCTION_DIFFERS.get("mean-keepdim"),
    )
    assert all(s.inputs[0] != (torch.distributed.tensor.Shard(2),) for s in strategies)


# --------------------------------------------------------------------------------------------
# Norms and softmax

NORM_CASES = [
    pytest.param(
        aten.layer_norm.default, (rand(2, 4, 6), [6], rand(6), rand(6), 1e-5), {}, id="layer_norm"
    ),
    pytest.param(
        aten.layer_norm.default, (rand(2, 4, 6), [4, 6]), {}, id="layer_norm-2d-no-affine"
    ),
    pytest.param(
        aten.native_layer_norm.default,
        (rand(2, 4, 6), [6], rand(6), rand(6), 1e-5),
        {},
        id="native_layer_norm",
    ),
    pytest.param(aten.rms_norm.default, (rand(2, 4, 6), [6], rand(6), 1e-6), {}, id="rms_norm"),
    pytest.param(aten.softmax.int, (rand(2, 4, 6), -1), {}, id="softmax"),
    pytest.param(aten._softmax.default, (rand(2, 4, 6), 1, False), {}, id="_softmax"),
    pytest.param(aten.log_softmax.int, (rand(2, 4, 6), -1), {}, id="log_softmax"),
    pytest.param(aten._log_softmax.default, (rand(4, 6), 1, False), {}, id="_log_softmax"),
    pytest.param(aten._safe_softmax.default, (rand(2, 4, 6), -1), {}, id="_safe_softmax"),
]

NORM_DIFFERS: dict[str, dict[str, str]] = {}


@pytest.mark.parametrize("op,args,kwargs", NORM_CASES)
def test_norms_match_oracle(op, args, kwargs, request) -> None:
    case = request.node.callspec.id
    check_rule(op, args, kwargs, dtensor_differs=NORM_DIFFERS.get(case))


# --------------------------------------------------------------------------------------------
# Losses


def _targets(n: int, classes: int, *, ignore: bool = True) -> torch.Tensor:
    t = torch.randint(0, classes, (n,))
    if ignore:
        t[1] = -100
    return t


LOSS_CASES = [
    pytest.param(aten.cross_entropy_loss.default, (rand(8, 5), _targets(8, 5)), {}, id="ce-mean"),
    pytest.param(
        aten.cross_entropy_loss.default, (rand(8, 5), _targets(8, 5), None, 2), {}, id="ce-sum"
    ),
    pytest.param(
        aten.cross_entropy_loss.default,
        (rand(8, 5), _targets(8, 5), rand(5).abs(), 0),
        {},
        id="ce-none-weight",
    ),
    pytest.param(
        aten.cross_entropy_loss.default,
        (rand(4, 5, 6), torch.randint(0, 5, (4, 6)), None, 2),
        {},
        id="ce-spatial-sum",
    ),
    pytest.param(
        aten.cross_entropy_loss.default,
        (rand(8, 5), rand(8, 5).softmax(-1), None, 2, -100, 0.1),
        {},
        id="ce-prob-sum",
    ),
    pytest.param(
        aten.nll_loss_forward.default,
        (rand(8, 5), _targets(8, 5), None, 2, -100),
        {},
        id="nll_forward-sum",
    ),
    pytest.param(
        aten.nll_loss_forward.default,
        (rand(8, 5), _targets(8, 5), None, 0, -100),
        {},
        id="nll_forward-none",
    ),
    pytest.param(
        aten.nll_loss_forward.default,
        (rand(8, 5), _targets(8, 5), None, 1, -100),
        {},
        id="nll_forward-mean",
    ),
    pytest.param(
        aten.nll_loss.default, (rand(8, 5), _targets(8, 5)), {"reduction": 2}, id="nll-sum"
    ),
    pytest.param(aten.mse_loss.default, (rand(4, 6), rand(4, 6)), {}, id="mse-mean"),
    pytest.param(aten.mse_loss.default, (rand(4, 6), rand(4, 6), 2), {}, id="mse-sum"),
    pytest.param(aten.mse_loss.default, (rand(4, 6), rand(4, 6), 0), {}, id="mse-none"),
]

LOSS_DIFFERS: dict[str, dict[str, str]] = {}


@pytest.mark.parametrize("op,args,kwargs", LOSS_CASES)
def test_losses_match_oracle(op, args, kwargs, request) -> None:
    case = request.node.callspec.id
    check_rule(op, args, kwargs, dtensor_differs=LOSS_DIFFERS.get(case))


def test_mean_losses_are_only_replicated() -> None:
    for op, args in [
        (aten.cross_entropy_loss.default, (rand(8, 5), _targets(8, 5))),
        (aten.mse_loss.default, (rand(4, 6), rand(4, 6))),
    ]:
        strategies = check_rule(op, args, {}, mesh_shapes=((2,),))
        assert len(strategies) == 1


# --------------------------------------------------------------------------------------------
# Coverage of the zoo's ops

COMPUTE_FAMILY_PREFIXES = tuple(
    """
    aten.linear aten.addmm aten.mm aten.bmm aten.matmul aten.baddbmm aten.einsum aten.add
    aten.sub aten.rsub aten.mul aten.div aten.neg aten.pow aten.rsqrt aten.sqrt aten.exp
    aten.log aten.tanh aten.gelu aten.silu aten.relu aten.sigmoid aten.where aten.masked_fill
    aten.eq aten.ne aten.lt aten.gt aten.ge aten.le aten.logical_ aten.__and__ aten.__or__
    aten.bitwise_ aten.clamp aten._to_copy aten.to. aten.type_as aten.fill aten.zeros_like
    aten.ones_like aten.full_like aten.cos aten.sin aten.sum aten.mean aten.amax aten.amin
    aten.max aten.min aten.var aten.std aten.cumsum aten.diff aten.layer_norm
    aten.native_layer_norm aten.rms_norm aten.softmax aten._softmax aten.log_softmax
    aten._log_softmax aten._safe_softmax aten.cross_entropy_loss aten.nll_loss aten.mse_loss
    aten.contiguous aten.clone
    """.split()
)


def _in_compute_families(target: object) -> bool:
    return str(target).startswith(COMPUTE_FAMILY_PREFIXES)


@pytest.fixture(scope="module")
def zoo_graphs() -> dict[str, torch.fx.Graph]:
    pytest.importorskip("transformers")
    from tests.models import ALL_MODELS

    graphs = {}
    for name, build in ALL_MODELS.items():
        model, args, kwargs = build()
        model.train()
        graphs[name] = torch.export.export(model, args, kwargs, strict=False).graph
    return graphs


def test_every_compute_op_of_the_zoo_has_a_rule(zoo_graphs) -> None:
    missing = sorted(
        {
            f"{name}: {node.target}"
            for name, graph in zoo_graphs.items()
            for node in graph.nodes
            if node.op == "call_function"
            and _in_compute_families(node.target)
            and get_rule(node.target) is None
        }
    )
    assert not missing, f"compute ops of the zoo without a rule: {missing}"


def test_zoo_compute_nodes_expand_on_a_2x2_mesh(zoo_graphs) -> None:
    # Every rule accepts the real call shapes of the zoo (kwargs, negative dims, 0-d operands)
    # and gives the replicated strategy plus at least one split one for every float op.
    for name, graph in zoo_graphs.items():
        for node in graph.nodes:
            if node.op != "call_function" or not _in_compute_families(node.target):
                continue
            strategies, warning = strategies_for(node, (2, 2))
            assert warning is None, f"{name}: {warning}"
            assert any(
                all(p is None or all(x.is_replicate() for x in p) for p in (*s.inputs, *s.outputs))
                for s in strategies
            ), f"{name}: {node.format_node()} has no replicated strategy"
            value = node.meta.get("val")
            if (
                isinstance(value, torch.Tensor)
                and value.dtype.is_floating_point
                and value.ndim > 0
                and "loss" not in str(node.target)
            ):
                assert len(strategies) > 1, f"{name}: {node.format_node()} only runs replicated"


# --------------------------------------------------------------------------------------------
# The oracle itself: it must reject wrong strategies (engineer E's rules rely on it too)


def _strategy(inputs: str, output: str, grads: str) -> Strategy:
    """A hand-written strategy: space-separated per-tensor placements, e.g. ``"S0 R"``."""

    def parse(text: str) -> tuple:
        return tuple(parse_placements(t) for t in text.split())

    return Strategy(parse(output), parse(inputs), parse(grads))


@pytest.mark.parametrize(
    "inputs,output,grads",
    [
        pytest.param("R R", "S0", "R R", id="output-not-split"),
        pytest.param("S0 R", "P", "S0 P", id="rows-are-not-partial"),
        pytest.param("P P", "P", "R R", id="bilinear-in-two-partials"),
        pytest.param("S0 R", "S0", "S0 R", id="weight-grad-is-partial-not-replicate"),
        pytest.param("R S1", "S1", "R S1", id="input-grad-is-partial-not-replicate"),
    ],
)
def test_oracle_rejects_wrong_strategies(inputs, output, grads) -> None:
    with pytest.raises(AssertionError):
        simulate(
            aten.mm.default, (rand(4, 8), rand(8, 6)), {}, _strategy(inputs, output, grads), (2,)
        )


def test_oracle_accepts_the_row_parallel_matmul() -> None:
    simulate(aten.mm.default, (rand(4, 8), rand(8, 6)), {}, _strategy("S1 S0", "P", "S1 S0"), (2,))


def test_oracle_asks_dtensor_without_redistributing() -> None:
    row_parallel = _strategy("S1 S0", "P", "S1 S0")
    theirs = dtensor_output_placements(
        aten.mm.default, (rand(4, 8), rand(8, 6)), {}, row_parallel, (2,)
    )
    assert theirs == (parse_placements("P"),)
    # gelu of a Partial input: DTensor must reduce it first, so it has no such strategy.
    gelu_of_partial = _strategy("P", "P", "R")
    assert (
        dtensor_output_placements(aten.gelu.default, (rand(4, 6),), {}, gelu_of_partial, (2,))
        is None
    )


def test_matmul_and_layer_norm_on_a_3d_mesh() -> None:
    # Numeric simulation only: DTensor's planner takes about a second per strategy on 3-D meshes,
    # and the same rules were compared with DTensor on 1-D and 2-D meshes above.
    strategies = check_rule(
        aten.linear.default,
        (rand(8, 8), rand(8, 8), rand(8)),
        {},
        mesh_shapes=((2, 2, 2),),
        dtensor_mesh_shapes=(),
    )
    assert "[S0,R,R R,S0,S0 R,S0,S0] -> [S0,S1,S1]" in {s.describe() for s in strategies}
    check_rule(
        aten.layer_norm.default,
        (rand(4, 4, 6), [6], rand(6), rand(6)),
        {},
        mesh_shapes=((2, 1, 2),),
        dtensor_mesh_shapes=(),
    )
