"""Sample calls of every ATen op the test model zoo uses, for strategy conformance tests.

One :class:`OpSample` per representative use of an op in ``tests/models.py`` (tiny MLP, GPT,
LLaMA, Hugging Face GPT-2 and LLaMA): the same argument structure (keyword arguments, list
inputs, scalar operands, broadcasting, bool and int64 tensors) with small shapes whose every
dim is 1 or divisible by 4, so a (2,) and a (2, 2) mesh can split any dim. Float tensors are
float64 so that comparisons of sharded against unsharded results can be tight. The shapes
follow the strategy tests (``tests/planner/test_strategies_*.py``).

:func:`build_samples` draws the tensors from a fixed seed, so every rank of a distributed test
builds identical full inputs.

``python -m tests.op_samples`` prints the "Supported ops" section of README.md from the
strategy registry (:func:`supported_ops_markdown`); a test checks that README.md holds it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten
F64 = torch.float64
CPU = torch.device("cpu")
MAXINT = 9223372036854775807

__all__ = ["OpSample", "build_samples", "sample_ops", "supported_ops_markdown"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OpSample:
    """One call ``op(*args, **kwargs)`` on full (unsharded) tensors."""

    name: str
    """Unique id, ``<op>/<use>``."""
    op: Any
    """The ATen OpOverload."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def build_samples(seed: int = 0) -> list[OpSample]:
    """Every sample, with tensors drawn from ``seed`` (identical on every call)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    def ints(*shape: int, high: int = 8) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=gen)

    def mask(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen) > 0.3

    samples: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = [
        # Matmul family
        ("linear/mlp", aten.linear.default, (rand(4, 8), rand(16, 8), rand(16)), {}),
        ("linear/qkv", aten.linear.default, (rand(4, 4, 8), rand(16, 8), rand(16)), {}),
        ("linear/no_bias", aten.linear.default, (rand(4, 4, 8), rand(8, 8)), {}),
        ("addmm/conv1d", aten.addmm.default, (rand(16), rand(16, 8), rand(8, 16)), {}),
        # Attention
        (
            "sdpa/causal",
            aten.scaled_dot_product_attention.default,
            (rand(4, 4, 8, 4), rand(4, 4, 8, 4), rand(4, 4, 8, 4), None, 0.0, True),
            {},
        ),
        (
            "sdpa/bool_mask",
            aten.scaled_dot_product_attention.default,
            (rand(4, 4, 8, 4), rand(4, 4, 8, 4), rand(4, 4, 8, 4), mask(4, 1, 8, 8)),
            {"scale": 0.5},
        ),
        # Embedding
        ("embedding/tokens", aten.embedding.default, (rand(16, 8), ints(4, 8, high=16)), {}),
        ("embedding/positions", aten.embedding.default, (rand(8, 8), ints(8)), {}),
        (
            "embedding/padding_idx",
            aten.embedding.default,
            (rand(16, 8), ints(4, 8, high=16), 0),
            {},
        ),
        # Norms
        (
            "layer_norm/affine",
            aten.layer_norm.default,
            (rand(4, 4, 8), [8], rand(8), rand(8), 1e-5, False),
            {},
        ),
        # Losses
        (
            "cross_entropy_loss/sum",
            aten.cross_entropy_loss.default,
            (rand(16, 8), ints(16), None, 2, -100, 0.0),
            {},
        ),
        ("mse_loss/sum", aten.mse_loss.default, (rand(4, 8), rand(4, 8), 2), {}),
        # Pointwise
        ("add/residual", aten.add.Tensor, (rand(4, 4, 8), rand(4, 4, 8)), {}),
        ("add/broadcast_positions", aten.add.Tensor, (rand(4, 4, 8), rand(4, 8)), {}),
        ("add/broadcast_leading_one", aten.add.Tensor, (rand(4, 4, 8), rand(1, 4, 8)), {}),
        ("add/scalar", aten.add.Tensor, (rand(4, 4, 1), 1e-5), {}),
        ("add/int_scalar", aten.add.Tensor, (ints(8), 0), {}),
        ("sub/tensor", aten.sub.Tensor, (rand(4, 4, 2, 4), rand(4, 4, 2, 4)), {}),
        ("sub/int_scalar", aten.sub.Tensor, (ints(4, 1), 1), {}),
        ("mul/rmsnorm_scale", aten.mul.Tensor, (rand(4, 4, 8), rand(4, 4, 1)), {}),
        ("mul/weight", aten.mul.Tensor, (rand(8), rand(4, 4, 8)), {}),
        ("mul/rotary", aten.mul.Tensor, (rand(4, 4, 2, 4), rand(1, 4, 1, 4)), {}),
        ("mul/scalar", aten.mul.Tensor, (rand(4, 4, 16), 0.5), {}),
        ("mul/gate", aten.mul.Tensor, (rand(4, 4, 16), rand(4, 4, 16)), {}),
        ("div/scalar", aten.div.Scalar, (rand(4, 4, 1), 64), {}),
        ("div/scalar_0d", aten.div.Scalar, (rand(()), 512), {}),
        ("div/loss_by_count", aten.div.Tensor, (rand(()), torch.tensor(12)), {}),
        ("neg/rotate_half", aten.neg.default, (rand(4, 2, 8, 4),), {}),
        ("contiguous/ids", aten.contiguous.default, (ints(4, 8),), {}),
        ("gelu/mlp", aten.gelu.default, (rand(4, 4, 16),), {}),
        ("silu/mlp", aten.silu.default, (rand(4, 4, 16),), {}),
        ("tanh/gelu_new", aten.tanh.default, (rand(4, 4, 16),), {}),
        ("rsqrt/rmsnorm", aten.rsqrt.default, (rand(4, 4, 1).abs() + 0.5,), {}),
        ("pow/square", aten.pow.Tensor_Scalar, (rand(4, 4, 8), 2), {}),
        ("pow/cube", aten.pow.Tensor_Scalar, (rand(4, 4, 16), 3.0), {}),
        ("cos/rotary", aten.cos.default, (rand(1, 8, 8),), {}),
        ("sin/rotary", aten.sin.default, (rand(1, 8, 8),), {}),
        ("ne/ignore_index", aten.ne.Scalar, (ints(16), -100), {}),
        ("ne/padding", aten.ne.Scalar, (ints(4, 8), 1), {}),
        ("eq/mask", aten.eq.Tensor, (ints(4, 1, 8, 1), ints(4, 1, 1, 8)), {}),
        ("le/causal", aten.le.Tensor, (ints(4, 1, 1, 8), ints(4, 1, 8, 1)), {}),
        ("__and__/mask", aten.__and__.Tensor, (mask(4, 1, 8, 8), mask(4, 1, 8, 8)), {}),
        ("__and__/scalar_mask", aten.__and__.Tensor, (torch.tensor(True), mask(4, 1, 8, 8)), {}),
        ("to/dtype", aten.to.dtype, (rand(4, 4, 8), F64), {}),
        ("to/dtype_int_to_float", aten.to.dtype, (ints(1, 8, 1), F64), {}),
        ("to/device", aten.to.device, (rand(8), CPU, F64), {}),
        (
            "to/dtype_layout",
            aten.to.dtype_layout,
            (rand(1, 8, 8),),
            {"dtype": F64, "layout": torch.strided, "device": CPU},
        ),
        ("type_as/rotary", aten.type_as.default, (rand(4, 4, 2, 8), rand(4, 4, 2, 8)), {}),
        # Reductions and scans
        ("sum/count", aten.sum.default, (mask(16),), {}),
        ("sum/float", aten.sum.default, (rand(4, 8),), {}),
        ("sum/rms_keepdim", aten.sum.dim_IntList, (rand(4, 4, 8), [-1], True), {}),
        ("cumsum/positions", aten.cumsum.default, (mask(4, 8), -1), {}),
        ("diff/prepend", aten.diff.default, (ints(4, 8), 1, -1, ints(4, 1)), {}),
        # Views and shape ops
        ("view/split_heads", aten.view.default, (rand(4, 8, 16), [4, 8, 4, 4]), {}),
        ("view/flatten_logits", aten.view.default, (rand(4, 4, 8), [-1, 8]), {}),
        ("view/flatten_targets", aten.view.default, (ints(4, 4), [-1]), {}),
        ("view/unflatten_rows", aten.view.default, (rand(16, 8), [4, 4, 8]), {}),
        ("view/rotary_table", aten.view.default, (rand(8, 4), [1, 8, 1, 4]), {}),
        ("reshape/merge_heads", aten.reshape.default, (rand(4, 8, 4, 4), [4, 8, 16]), {}),
        ("reshape/rotary_pairs", aten.reshape.default, (rand(4, 8, 4, 8), [4, 8, 4, 4, 2]), {}),
        ("reshape/repeat_kv", aten.reshape.default, (rand(4, 2, 2, 8, 8), [4, 4, 8, 8]), {}),
        ("transpose/heads", aten.transpose.int, (rand(4, 8, 4, 4), 1, 2), {}),
        ("unsqueeze/positions", aten.unsqueeze.default, (ints(8), 0), {}),
        ("unsqueeze/mask", aten.unsqueeze.default, (rand(4, 2, 8, 8), 2), {}),
        ("expand/positions", aten.expand.default, (ints(1, 8), [4, -1]), {}),
        ("expand/repeat_kv", aten.expand.default, (rand(4, 2, 1, 8, 8), [4, 2, 2, 8, 8]), {}),
        ("expand/mask", aten.expand.default, (mask(4, 1, 8, 8), [4, -1, 8, 8]), {}),
        ("alias/hidden", aten.alias.default, (rand(4, 4, 8),), {}),
        (
            "broadcast_tensors/mse",
            aten.broadcast_tensors.default,
            ([rand(4, 8), rand(4, 8)],),
            {},
        ),
        ("split/qkv", aten.split.Tensor, (rand(4, 4, 24), 8, 2), {}),
        ("select/rotary_pair", aten.select.int, (rand(4, 4, 2, 4, 2), 4, 0), {}),
        ("slice/rope_table", aten.slice.Tensor, (rand(16, 8), 0, 0, 8), {}),
        ("slice/labels_shift", aten.slice.Tensor, (ints(4, 9), 1, 1, MAXINT), {}),
        ("slice/first_column", aten.slice.Tensor, (ints(4, 8), 1, 0, 1), {}),
        ("slice/rotate_half", aten.slice.Tensor, (rand(4, 2, 8, 8), 3, 0, 4), {}),
        ("cat/rotate_half", aten.cat.default, ([rand(4, 2, 8, 4), rand(4, 2, 8, 4)], -1), {}),
        ("cat/rotary_table", aten.cat.default, ([rand(1, 8, 4), rand(1, 8, 4)], -1), {}),
        ("stack/rotary", aten.stack.default, ([rand(4, 4, 2, 4), rand(4, 4, 2, 4)], -1), {}),
        (
            "repeat_interleave/kv_heads",
            aten.repeat_interleave.self_int,
            (rand(4, 2, 8, 4), 2, 1),
            {},
        ),
        (
            "index/gather_mask",
            aten.index.Tensor,
            (ints(4, 8), [ints(4, 1, 1, 1, high=4), ints(1, 1, 8, 1)]),
            {},
        ),
        ("pad/labels", aten.pad.default, (ints(4, 8), [0, 1], "constant", -100.0), {}),
        # Factories and dropout
        (
            "arange/positions",
            aten.arange.default,
            (8,),
            {"device": CPU, "pin_memory": False},
        ),
        (
            "new_ones/mask",
            aten.new_ones.default,
            (ints(1, 1, 8, 1), []),
            {"dtype": torch.bool, "pin_memory": False},
        ),
        ("dropout/p0_train", aten.dropout.default, (rand(4, 4, 8), 0.0, True), {}),
        # Vocab-parallel cross entropy (class dim sharded): ignored targets, every reduction,
        # label smoothing, spatial dims. Drawn last so the samples above keep their values.
        (
            "cross_entropy_loss/mean_ignore_index",
            aten.cross_entropy_loss.default,
            (rand(16, 8), ints(16).index_fill(0, torch.tensor([1, 6, 11]), -100)),
            {},
        ),
        (
            "cross_entropy_loss/none_label_smoothing",
            aten.cross_entropy_loss.default,
            (rand(16, 8), ints(16).index_fill(0, torch.tensor([2, 9]), -100), None, 0),
            {"label_smoothing": 0.1},
        ),
        (
            "cross_entropy_loss/sum_spatial_smoothing",
            aten.cross_entropy_loss.default,
            (rand(4, 8, 4), ints(4, 4), None, 2, -100, 0.2),
            {},
        ),
    ]
    return [OpSample(name=n, op=op, args=a, kwargs=k) for n, op, a, k in samples]


def sample_ops() -> set[Any]:
    """The ops :func:`build_samples` covers."""
    return {sample.op for sample in build_samples()}


# --------------------------------------------------------------------------------------------
# README's list of supported ops, generated from the registry

_FAMILY_TITLES = {
    "matmul": "matmul",
    "attention": "attention",
    "embedding": "embedding",
    "norms": "normalization and softmax",
    "losses": "losses",
    "reductions": "reductions and scans",
    "views": "views, shape ops, indexing",
    "factory": "factories",
    "dropout": "dropout",
    "pointwise": "elementwise (every overload but `out=` ones, in-place variants too)",
}


def supported_ops_markdown() -> str:
    """The README section listing every op with a sharding rule, grouped by rule family."""
    import autopar.strategies  # noqa: F401  (registers every rule)
    from autopar.strategies.registry import get_rule, registered_ops

    families: dict[str, set[str]] = {}
    for op in registered_ops():
        if op is operator.getitem:
            continue
        rule = get_rule(op)
        assert rule is not None
        family = rule.__module__.rsplit(".", 1)[-1]
        if family == "pointwise":
            name = op.overloadpacket.__name__
            if name.endswith("_") and not name.endswith("__"):
                name = name[:-1]  # the in-place variant of an op listed without it
        else:
            name = op._opname + ("" if op._overloadname == "default" else f".{op._overloadname}")
        families.setdefault(family, set()).add(name)
    order: Callable[[str], tuple[int, str]] = lambda f: (  # noqa: E731
        list(_FAMILY_TITLES).index(f) if f in _FAMILY_TITLES else len(_FAMILY_TITLES),
        f,
    )
    count = sum(len(names) for names in families.values())
    lines = [
        "## Supported ops",
        "",
        f"ATen ops with a sharding rule ({count}; this list is generated by",
        "`python -m tests.op_samples`). Every strategy of every op the test models use is run on",
        "sharded inputs on gloo ranks (meshes 2 and 2x2) and compared, output and input gradients,",
        "with the unsharded op: `tests/distributed/test_conformance.py`. An op without a rule",
        "runs replicated, with a plan warning.",
        "",
    ]
    for family in sorted(families, key=order):
        names = ", ".join(f"`{n}`" for n in sorted(families[family]))
        lines.append(f"- **{_FAMILY_TITLES.get(family, family)}**: {names}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(supported_ops_markdown(), end="")
