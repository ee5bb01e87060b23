"""Rules for view/shape ops, embedding, attention, dropout and factories (engineer E's families).

Every strategy of every covered op is simulated numerically per rank (forward and backward,
tests/strategy_oracle.simulate) and compared with DTensor's own propagation; where DTensor
disagrees the case names the reason. Shapes are the ones the zoo models produce, scaled down.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch

import autopar.strategies  # noqa: F401  (registers every rule)
from autopar.placement import PARTIAL, Partial, Replicate, Shard
from autopar.strategies.embedding import vocab_parallel_embedding
from autopar.strategies.registry import expand, get_rule
from autopar.strategies.views import view_dim_map, view_groups
from tests.strategy_oracle import (
    _assemble,
    _coords,
    _local_value,
    _partial_parts,
    call_from_args,
    check_rule,
    dtensor_output_placements,
    simulate,
)

aten = torch.ops.aten
MESHES = ((2,), (2, 2))
MESHES_3D = ((2,), (2, 2), (2, 2, 2))
MAXINT = 9223372036854775807


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def ints(*shape: int, high: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def local_size(position: int) -> Callable[[tuple, dict, tuple], tuple[tuple, dict]]:
    """adjust_args for shape-taking ops: the size argument at ``position`` becomes the local
    output shape (what the lowering does to view/reshape/expand arguments)."""

    def adjust(args: tuple, kwargs: dict, out_shapes: tuple) -> tuple[tuple, dict]:
        args = list(args)
        args[position] = list(out_shapes[0])
        return tuple(args), kwargs

    return adjust


def local_unflatten(args: tuple, kwargs: dict, out_shapes: tuple) -> tuple[tuple, dict]:
    x, dim, sizes = args
    dim %= x.ndim
    return (x, dim, list(out_shapes[0][dim : dim + len(sizes)])), kwargs


# DTensor reasons shared by several cases.
DT_SPLIT_ORDER = (
    "DTensor's view propagation does not keep a Shard on a dim of a multi-dim group whose sizes "
    "do not factor one into the other (m-to-k reshape); ours is exact (simulated)"
)
DT_EXPAND_PARTIAL = "DTensor replicates a Partial input of expand; expand is linear, P -> P is exact (simulated)"


# --------------------------------------------------------------------------------------------
# View grouping helper


def test_view_groups_split_merge_and_size_one_dims() -> None:
    assert view_groups((8, 16, 64), (8, 16, 4, 16)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert view_groups((8, 16, 4, 16), (8, 16, 64)) == [([0], [0]), ([1], [1]), ([2, 3], [2])]
    assert view_groups((8, 16, 128), (128, 128)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((16, 8), (1, 16, 1, 8)) == [([0], [1]), ([1], [3])]
    assert view_groups((6, 4), (4, 6)) == [([0, 1], [0, 1])]
    assert view_dim_map((8, 2, 2, 16, 16), (8, 4, 16, 16)) == {0: 0, 1: 1, 3: 2, 4: 3}
    assert view_dim_map((8, 16), (128,)) == {0: 0}
    with pytest.raises(ValueError):
        view_groups((4, 4), (3, 5))


def test_view_keeps_only_the_outer_dim_of_a_merged_group() -> None:
    x = rand(4, 4, 8)
    call = call_from_args(aten.view.default, (x, [16, 8]), {})
    shards = {
        (s.inputs[0][0].dim, s.outputs[0][0].dim)
        for s in expand(call, get_rule(aten.view.default)(call), (2,))
        if isinstance(s.inputs[0][0], Shard)
    }
    # dim 1 is the inner dim of the merged group {0, 1}: sharding it would interleave.
    assert shards == {(0, 0), (2, 1)}


# --------------------------------------------------------------------------------------------
# Views and shape ops: (id, op, args, kwargs, adjust_args, dtensor_differs, meshes)

Case = tuple[str, Any, tuple, dict, Any, dict[str, str], tuple]

VIEW_CASES: list[Case] = [
    # attention head split / merge (GPT, LLaMA), loss flatten, rotary pairs, rotary table
    ("head_split", aten.view.default, (rand(4, 4, 16), [4, 4, 4, 4]), {}, local_size(1), {}, MESHES_3D),
    ("head_split_minus1", aten.view.default, (rand(4, 4, 16), [4, 4, -1, 4]), {}, local_size(1), {}, MESHES),
    ("head_merge", aten.reshape.default, (rand(4, 4, 4, 4), [4, 4, 16]), {}, local_size(1), {}, MESHES_3D),
    ("loss_flatten", aten.view.default, (rand(4, 4, 8), [-1, 8]), {}, local_size(1), {}, MESHES),
    ("targets_flatten", aten.view.default, (ints(4, 4), [-1]), {}, local_size(1), {}, MESHES),
    ("rotary_pairs", aten.reshape.default, (rand(4, 4, 2, 8), [4, 4, 2, 4, 2]), {}, local_size(1), {}, MESHES),
    ("rotary_unpairs", aten.reshape.default, (rand(4, 4, 2, 4, 2), [4, 4, 2, 8]), {}, local_size(1), {}, MESHES),
    ("rotary_table", aten.view.default, (rand(8, 4), [1, 8, 1, 4]), {}, local_size(1), {}, MESHES),
    ("gqa_merge", aten.reshape.default, (rand(4, 2, 2, 4, 4), [4, 4, 4, 4]), {}, local_size(1), {}, MESHES),
    ("linear_unflatten", aten.view.default, (rand(16, 8), [4, 4, 8]), {}, local_size(1), {}, MESHES),
    ("m_to_k", aten.view.default, (rand(6, 4), [4, 6]), {}, local_size(1),
     {"re:S0": DT_SPLIT_ORDER}, ((2,),)),
    ("unsafe_view", aten._unsafe_view.default, (rand(4, 4, 8), [16, 8]), {}, local_size(1), {}, MESHES),
    ("flatten", aten.flatten.using_ints, (rand(4, 4, 8), 0, 1), {}, None, {}, MESHES),
    ("unflatten", aten.unflatten.int, (rand(4, 16), 1, [4, 4]), {}, local_unflatten, {}, MESHES),
    ("squeeze_dim", aten.squeeze.dim, (rand(4, 1, 8), 1), {}, None, {}, MESHES),
    ("squeeze_all", aten.squeeze.default, (rand(4, 1, 8, 1),), {}, None, {}, MESHES),
    ("squeeze_dims", aten.squeeze.dims, (rand(4, 1, 8, 1), [1, 3]), {}, None, {}, MESHES),
    ("unsqueeze", aten.unsqueeze.default, (rand(4, 2, 4, 4), 2), {}, None, {}, MESHES),
    ("unsqueeze_int", aten.unsqueeze.default, (ints(8, 4), -1), {}, None, {}, MESHES),
    ("view_as", aten.view_as.default, (rand(4, 16), rand(4, 4, 4)), {}, None,
     {"re:-> \\[R\\]$": "DTensor view_as ignores the shape donor's layout; ours replicates it",
      "re:-> \\[R,R\\]$": "as above"}, MESHES),
    # permutations and identities
    ("transpose", aten.transpose.int, (rand(4, 4, 2, 4), 1, 2), {}, None, {}, MESHES_3D),
    ("transpose_neg", aten.transpose.int, (rand(4, 4, 8), -1, 0), {}, None, {}, MESHES),
    ("t", aten.t.default, (rand(4, 8),), {}, None, {}, MESHES),
    ("permute", aten.permute.default, (rand(4, 2, 4, 8), [0, 2, 1, 3]), {}, None, {}, MESHES),
    ("movedim", aten.movedim.int, (rand(4, 2, 8), 0, -1), {}, None, {}, MESHES),
    ("contiguous", aten.contiguous.default, (rand(4, 4, 2, 4).transpose(1, 2),), {}, None, {}, MESHES),
    ("clone", aten.clone.default, (rand(4, 8),), {}, None, {}, MESHES),
    ("alias", aten.alias.default, (rand(4, 8),), {}, None, {}, MESHES),
    ("detach", aten.detach.default, (rand(4, 8),), {}, None, {}, MESHES),
    ("lift_fresh_copy", aten.lift_fresh_copy.default, (rand(4, 8),), {}, None,
     {"*": "DTensor has no lift_fresh_copy rule (an identity); simulated"}, MESHES),
    # broadcasting
    ("expand_positions", aten.expand.default, (ints(1, 8), [4, -1]), {}, local_size(1),
     {"re:P": DT_EXPAND_PARTIAL}, MESHES),
    ("expand_mask", aten.expand.default, (ints(4, 1, 8, 8, high=2).bool(), [4, -1, 8, 8]), {}, local_size(1), {}, MESHES),
    ("expand_gqa", aten.expand.default, (rand(4, 2, 1, 4, 4), [4, 2, 2, 4, 4]), {}, local_size(1),
     {"re:P": DT_EXPAND_PARTIAL}, MESHES),
    ("expand_new_dims", aten.expand.default, (rand(8,), [2, 4, 8]), {}, local_size(1),
     {"re:P": DT_EXPAND_PARTIAL}, MESHES),
    ("expand_as", aten.expand_as.default, (rand(4, 1, 8), rand(4, 4, 8)), {}, None,
     {"re:P": DT_EXPAND_PARTIAL}, MESHES),
    ("broadcast_tensors", aten.broadcast_tensors.default, ([rand(4, 8), rand(4, 8, seed=1)],), {}, None, {}, MESHES),
    ("broadcast_tensors_bcast", aten.broadcast_tensors.default, ([rand(4, 1, 8), rand(4, 8, seed=1)],), {}, None,
     {"re:P": "DTensor replicates Partial inputs of broadcast_tensors; broadcasting is linear (simulated)"}, MESHES),
    # splitting and joining
    ("split_qkv", aten.split.Tensor, (rand(4, 4, 24), 8, 2), {}, None, {}, MESHES_3D),
    ("split_with_sizes", aten.split_with_sizes.default, (rand(4, 12, 4), [4, 8], 1), {}, None, {}, MESHES),
    ("chunk", aten.chunk.default, (rand(4, 8, 4), 2, -1), {}, None, {}, MESHES),
    ("tensor_split", aten.tensor_split.sections, (rand(4, 6), 3, 1), {}, None,
     {"*": "DTensor has no tensor_split rule; simulated"}, MESHES),
    ("unbind", aten.unbind.int, (rand(4, 3, 8), 1), {}, None, {}, MESHES),
    ("select_rotary", aten.select.int, (rand(4, 4, 2, 4, 2), 4, 0), {}, None, {}, MESHES),
    ("select_neg", aten.select.int, (rand(4, 3, 8), -2, 1), {}, None, {}, MESHES),
    ("slice_rope_table", aten.slice.Tensor, (rand(32, 8), 0, 0, 16), {}, None, {}, MESHES),
    ("slice_labels_shift", aten.slice.Tensor, (ints(8, 17), 1, 1, MAXINT), {}, None, {}, MESHES),
    ("slice_rotate_half", aten.slice.Tensor, (rand(4, 2, 8, 8), 3, 4, MAXINT), {}, None, {}, MESHES),
    ("slice_whole", aten.slice.Tensor, (rand(4, 8), 1, 0, MAXINT), {}, None, {}, MESHES),
    ("narrow", aten.narrow.default, (rand(4, 8), 1, 2, 4), {}, None,
     {"*": "DTensor decomposes narrow into slice and agrees, or lacks it; simulated"}, MESHES),
    ("cat_rotate_half", aten.cat.default, ([rand(4, 2, 8, 4), rand(4, 2, 8, 4, seed=1)], -1), {}, None, {}, MESHES),
    ("cat_dim0", aten.cat.default, ([rand(4, 8), rand(2, 8, seed=1)], 0), {}, None, {}, MESHES),
    ("stack_rotary", aten.stack.default, ([rand(4, 4, 2, 4), rand(4, 4, 2, 4, seed=1)], -1), {}, None, {}, MESHES),
    ("stack_dim0", aten.stack.default, ([rand(4, 8), rand(4, 8, seed=1)],), {}, None, {}, MESHES),
    # repetition and gathering
    ("repeat_interleave_gqa", aten.repeat_interleave.self_int, (rand(4, 2, 4, 4), 2, 1), {}, None,
     {"re:S1|P": "DTensor replicates the repeated dim and Partial inputs of repeat_interleave; "
                 "an even split of the repeated dim maps to the same split of the output, and the op "
                 "is linear (simulated)"}, MESHES),
    ("repeat_interleave_flat", aten.repeat_interleave.self_int, (rand(4, 4), 2), {}, None,
     {"re:S|P": "DTensor replicates repeat_interleave without dim; flattening keeps blocks of dim 0 "
                "(simulated)"}, MESHES),
    ("repeat", aten.repeat.default, (rand(4, 4), [2, 1, 1]), {}, None,
     {"re:S|P": "DTensor lacks a sharded repeat; dims repeated once keep their blocks (simulated)"}, MESHES),
    ("index_select", aten.index_select.default, (rand(8, 4), 0, ints(4, high=8)), {}, None,
     {"re:S0\\] ->|P": "DTensor gathers a sharded index or a Partial self of index_select; "
                       "both are exact (simulated)"}, MESHES),
    ("pad_labels", aten.pad.default, (ints(8, 16), [0, 1], "constant", -100.0), {}, None,
     {"*": "DTensor has no aten.pad rule (CompositeImplicit on its side); simulated"}, MESHES),
    ("pad_zero", aten.constant_pad_nd.default, (rand(4, 6), [1, 1]), {}, None,
     {"re:P|S0": "DTensor replicates constant_pad_nd; unpadded dims and zero padding are exact "
                 "(simulated)"}, MESHES),
]


@pytest.mark.parametrize(
    "op,args,kwargs,adjust,differs,meshes",
    [pytest.param(*case[1:], id=case[0]) for case in VIEW_CASES],
)
def test_view_and_shape_rules_match_simulation_and_dtensor(
    op: Any, args: tuple, kwargs: dict, adjust: Any, differs: dict[str, str], meshes: tuple
) -> None:
    check_rule(op, args, kwargs, mesh_shapes=meshes, dtensor_differs=differs, adjust_args=adjust)


def test_split_never_shards_the_split_dim() -> None:
    call = call_from_args(aten.split.Tensor, (rand(4, 4, 24), 8, 2), {})
    for s in expand(call, get_rule(aten.split.Tensor)(call), (2, 2)):
        assert Shard(2) not in s.inputs[0]


def test_expand_keeps_broadcast_dims_replicated() -> None:
    call = call_from_args(aten.expand.default, (rand(4, 2, 1, 4, 4), [4, 2, 2, 4, 4]), {})
    for s in expand(call, get_rule(aten.expand.default)(call), (2,)):
        assert s.inputs[0] != (Shard(2),) and s.outputs[0] != (Shard(2),)


# --------------------------------------------------------------------------------------------
# Embedding


def _simulate_vocab_parallel(weight: torch.Tensor, idx: torch.Tensor, strategy: Any, mesh_shape: tuple) -> None:
    """The masked lookup per rank (what the lowering emits for a vocab-sharded weight), summed
    over the Partial axes, equals the full embedding."""
    full = aten.embedding(weight, idx)
    w_parts = _partial_parts(weight, strategy.inputs[0], mesh_shape, seed=3)
    i_parts = _partial_parts(idx, strategy.inputs[1], mesh_shape, seed=4)
    outs = {}
    for coord in _coords(mesh_shape):
        local_w = _local_value(weight, strategy.inputs[0], mesh_shape, coord, w_parts)
        local_i = _local_value(idx, strategy.inputs[1], mesh_shape, coord, i_parts)
        rows_per, index, count = weight.shape[0], 0, 1
        for axis, p in enumerate(strategy.inputs[0]):
            if p == Shard(0):
                index, count = index * mesh_shape[axis] + coord[axis], count * mesh_shape[axis]
        rows_per //= count
        outs[coord] = vocab_parallel_embedding(local_w, local_i, index * rows_per)
    got = _assemble(outs, strategy.outputs[0], mesh_shape, full.shape, "vocab parallel", rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(got, full)


@pytest.mark.parametrize(
    "idx",
    [pytest.param(ints(4, 8, high=16), id="tokens"), pytest.param(ints(8, high=16), id="positions")],
)
def test_embedding_strategies(idx: torch.Tensor) -> None:
    weight = rand(16, 8)
    call = call_from_args(aten.embedding.default, (weight, idx), {})
    vocab_sharded = 0
    for mesh_shape in MESHES_3D:
        for s in expand(call, get_rule(aten.embedding.default)(call), mesh_shape):
            theirs = dtensor_output_placements(aten.embedding.default, (weight, idx), {}, s, mesh_shape)
            if Shard(0) in s.inputs[0]:
                # Megatron's vocab-parallel embedding: Partial output; DTensor calls it _MaskPartial
                # (a sum-Partial) and computes it with the same masked lookup.
                vocab_sharded += 1
                _simulate_vocab_parallel(weight, idx, s, mesh_shape)
                for ours_p, their_p, w_p in zip(s.outputs[0], theirs[0], s.inputs[0]):
                    assert isinstance(their_p, Partial) == (w_p == Shard(0)), (s.describe(), theirs)
                    if w_p != Shard(0):
                        assert ours_p == their_p
                # The weight's gradient is sharded like the weight (each rank's rows).
                assert s.input_grads[0] == s.inputs[0]
                continue
            simulate(aten.embedding.default, (weight, idx), {}, s, mesh_shape)
            assert theirs is not None and tuple(theirs[0]) == s.outputs[0], (s.describe(), theirs)
    assert vocab_sharded > 0
    strategies = {s.describe() for s in expand(call, get_rule(aten.embedding.default)(call), (2,))}
    last = idx.ndim
    assert strategies == {"[R R] -> [R]", f"[S1 R] -> [S{last}]", "[S0 R] -> [P]"} | {
        f"[R S{d}] -> [S{d}]" for d in range(idx.ndim)
    }


def test_vocab_parallel_embedding_respects_padding_idx_rows() -> None:
    weight, idx = rand(8, 4), torch.tensor([[0, 3, 4, 7]])
    parts = [vocab_parallel_embedding(weight[r * 4 : (r + 1) * 4], idx, r * 4, padding_idx=3) for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], aten.embedding(weight, idx, 3))


# --------------------------------------------------------------------------------------------
# Attention

DT_SDPA = {
    # DTensor on CPU runs SDPA's math decomposition (bmm/softmax), which agrees on batch/head
    # sharding; query-sequence sharding with replicated k/v it resolves by its own bmm rules.
    "re:.": "compared where DTensor answers; every strategy simulated exactly",
}


def _sdpa_differs(op: Any, args: tuple, kwargs: dict, meshes: tuple) -> dict[str, str]:
    return DT_SDPA


SDPA_CASES = [
    # nanoGPT / tiny LLaMA: causal, no mask
    ("causal", (rand(4, 4, 8, 4), rand(4, 4, 8, 4, seed=1), rand(4, 4, 8, 4, seed=2)), {"is_causal": True}),
    # HF: explicit bool mask broadcast over heads, not causal, explicit scale
    ("hf_mask", (rand(4, 4, 8, 4), rand(4, 4, 8, 4, seed=1), rand(4, 4, 8, 4, seed=2),
                 torch.ones(4, 1, 8, 8, dtype=torch.bool).tril()), {"scale": 0.5}),
    # GQA through the op itself: 4 query heads, 2 KV heads
    ("gqa", (rand(4, 4, 8, 4), rand(4, 2, 8, 4, seed=1), rand(4, 2, 8, 4, seed=2)),
     {"is_causal": True, "enable_gqa": True}),
    # float additive bias, full rank
    ("bias", (rand(2, 4, 8, 4), rand(2, 4, 8, 4, seed=1), rand(2, 4, 8, 4, seed=2), rand(2, 4, 8, 8, seed=3)), {}),
]


@pytest.mark.parametrize("args,kwargs", [pytest.param(a, k, id=i) for i, a, k in SDPA_CASES])
def test_sdpa_strategies(args: tuple, kwargs: dict) -> None:
    op = aten.scaled_dot_product_attention.default
    strategies = check_rule(op, args, kwargs, mesh_shapes=MESHES, dtensor_differs=DT_SDPA, rtol=1e-6, atol=1e-8)
    seq_dim = args[0].ndim - 2
    seq_sharded = [s for s in strategies if Shard(seq_dim) in s.inputs[0]]
    assert bool(seq_sharded) == (not kwargs.get("is_causal", False))
    for s in strategies:
        # k/v are never sharded on their sequence or head dims, and nothing is Partial.
        for placements in s.inputs[1:3]:
            assert Shard(2) not in placements and Shard(3) not in placements
        assert PARTIAL not in s.outputs[0]


def test_sdpa_batch_and_heads_on_a_3d_mesh() -> None:
    op = aten.scaled_dot_product_attention.default
    args = (rand(4, 4, 4, 2), rand(4, 4, 4, 2, seed=1), rand(4, 4, 4, 2, seed=2))
    check_rule(op, args, {"is_causal": True}, mesh_shapes=((2, 2, 2),), dtensor_differs=DT_SDPA)


def test_sdpa_gqa_heads_need_both_counts_divisible() -> None:
    op = aten.scaled_dot_product_attention.default
    args = (rand(2, 4, 8, 4), rand(2, 2, 8, 4, seed=1), rand(2, 2, 8, 4, seed=2))
    call = call_from_args(op, args, {"is_causal": True, "enable_gqa": True})
    heads = [s for s in expand(call, get_rule(op)(call), (4,)) if s.inputs[0] == (Shard(1),)]
    assert heads == []  # 2 KV heads cannot split 4 ways even though 4 query heads can


def test_sdpa_flash_for_cpu_strategies() -> None:
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    args = (rand(4, 4, 8, 4), rand(4, 4, 8, 4, seed=1), rand(4, 4, 8, 4, seed=2), 0.0, False)
    strategies = check_rule(op, args, {}, mesh_shapes=MESHES,
                            dtensor_differs={"*": "DTensor has no rule for the CPU flash kernel; simulated"},
                            rtol=1e-6, atol=1e-8)
    assert any(s.outputs == ((Shard(2),), (Shard(2),)) for s in strategies)


# --------------------------------------------------------------------------------------------
# Dropout (p = 0 or eval mode: a sharded dropout draws different masks by design)

DROPOUT_CASES = [
    ("dropout_p0", aten.dropout.default, (rand(4, 4, 8), 0.0, True)),
    ("dropout_eval", aten.dropout.default, (rand(4, 4, 8), 0.1, False)),
    ("native_dropout", aten.native_dropout.default, (rand(4, 8), 0.0, True)),
    ("feature_dropout", aten.feature_dropout.default, (rand(4, 2, 8), 0.0, True)),
    ("alpha_dropout", aten.alpha_dropout.default, (rand(4, 8), 0.0, False)),
]


@pytest.mark.parametrize("op,args", [pytest.param(op, a, id=i) for i, op, a in DROPOUT_CASES])
def test_dropout_strategies(op: Any, args: tuple) -> None:
    differs = {
        "re:P": "DTensor treats dropout as random and refuses Partial; with p=0 / eval it is the identity",
        "re:.": "DTensor's random ops need an RNG tracker; it agrees on Shard/Replicate where it answers",
    }
    strategies = check_rule(op, args, {}, mesh_shapes=MESHES, dtensor_differs=differs)
    has_partial = any(PARTIAL in (s.outputs[0] or ()) for s in strategies)
    assert has_partial == (op in (aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default))


def test_training_dropout_never_passes_partial() -> None:
    call = call_from_args(aten.dropout.default, (rand(4, 8), 0.1, False), {})
    call = call.__class__(call.op, (call.args[0], 0.1, True), {}, call.inputs, call.outputs)
    options = get_rule(aten.dropout.default)(call)
    assert all(PARTIAL not in o.inputs for o in options)
    assert {o.inputs[0] for o in options} == {Replicate(), Shard(0), Shard(1)}


# --------------------------------------------------------------------------------------------
# Factories


FACTORY_CASES = [
    ("arange", aten.arange.default, (8,), {}),
    ("arange_start", aten.arange.start, (2, 10), {}),
    ("arange_step", aten.arange.start_step, (0, 8, 2), {}),
    ("zeros", aten.zeros.default, ([4, 4],), {"dtype": torch.float64}),
    ("ones", aten.ones.default, ([4, 4],), {"dtype": torch.float64}),
    ("full", aten.full.default, ([4, 4], 1.5), {"dtype": torch.float64}),
    ("scalar_tensor", aten.scalar_tensor.default, (2.0,), {"dtype": torch.float64}),
    ("eye", aten.eye.default, (4,), {"dtype": torch.float64}),
    ("new_ones_mask", aten.new_ones.default, (ints(1, 1, 8, 1), []), {"dtype": torch.bool}),
    ("new_zeros", aten.new_zeros.default, (rand(4, 8), [4]), {}),
    ("new_full", aten.new_full.default, (rand(4, 8), [4], 2.0), {}),
    ("zeros_like", aten.zeros_like.default, (rand(4, 8),), {}),
    ("ones_like", aten.ones_like.default, (rand(4, 8),), {}),
    ("full_like", aten.full_like.default, (rand(4, 8), 3.0), {}),
    ("assert_metadata", aten._assert_tensor_metadata.default, (rand(4, 8),), {"dtype": torch.float64}),
    ("tril", aten.tril.default, (rand(2, 4, 4),), {}),
    ("triu", aten.triu.default, (rand(2, 4, 4), 1), {}),
]


@pytest.mark.parametrize("op,args,kwargs", [pytest.param(op, a, k, id=i) for i, op, a, k in FACTORY_CASES])
def test_factory_strategies(op: Any, args: tuple, kwargs: dict) -> None:
    differs = {
        "re:-> \\[R": "the output is a constant built whole on every rank whatever the (metadata-only) "
                      "input's layout; DTensor propagates the input's layout instead",
        "re:P": "DTensor replicates a Partial input of tril/triu; masking is linear (simulated)",
    }
    check_rule(op, args, kwargs, mesh_shapes=MESHES, dtensor_differs=differs)


def test_empty_factories_expand_to_replicate_only() -> None:
    for op, args in [(aten.empty.memory_format, ([4, 4],)), (aten.new_empty.default, (rand(4, 4), [2]))]:
        call = call_from_args(op, args, {})
        for s in expand(call, get_rule(op)(call), (2, 2)):
            assert s.outputs[0] == (Replicate(), Replicate())


# --------------------------------------------------------------------------------------------
# Every op of these families in the zoo has a rule

FAMILIES = {
    # views and shape ops
    "view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "expand",
    "expand_as", "broadcast_tensors", "transpose", "t", "permute", "movedim", "contiguous",
    "clone", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind", "cat", "stack",
    "slice", "select", "narrow", "index_select", "repeat_interleave", "repeat", "pad",
    "constant_pad_nd", "view_as",
    # embedding, attention, dropout
    "embedding", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "dropout", "native_dropout",
    # factories
    "arange", "zeros", "ones", "full", "empty", "scalar_tensor", "tril", "triu", "lift_fresh_copy",
    "new_ones", "new_zeros", "new_full", "new_empty", "zeros_like", "ones_like", "full_like",
    "_assert_tensor_metadata",
}


@pytest.fixture(scope="module")
def zoo_targets() -> dict[str, set[Any]]:
    from tests.models import ALL_MODELS

    targets: dict[str, set[Any]] = {}
    for name, build in ALL_MODELS.items():
        model, args, kwargs = build()
        model.train()
        ep = torch.export.export(model, args, kwargs, strict=False)
        targets[name] = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    return targets


def test_every_zoo_op_of_these_families_has_a_rule(zoo_targets: dict[str, set[Any]]) -> None:
    missing = []
    seen = set()
    for name, targets in zoo_targets.items():
        for target in targets:
            if target is operator.getitem or not isinstance(target, torch._ops.OpOverload):
                continue
            if target.overloadpacket.__name__ in FAMILIES:
                seen.add(target.overloadpacket.__name__)
                if get_rule(target) is None:
                    missing.append(f"{name}: {target}")
    assert not missing, missing
    # The zoo really exercises the families (guards against an empty export).
    assert {"view", "reshape", "transpose", "embedding", "scaled_dot_product_attention"} <= seen
