"""Pricing pipeline stages from one intra-op ILP per (tensor-parallel size, microbatch).

A stage is a run of ``k`` repeated blocks, with the model's head end (embeddings: what comes
before the first block) on the first stage and its tail end (final norm, output layer, loss) on
the last. Its submesh is ``dp x tp`` ranks. The ILP (``Driver``'s configuration solver, every
layer of the stack tied) is solved once per (``tp``, local microbatch) on a *probe*: the model
(or a few-block variant of it) captured at the local microbatch shape on a 1-D ``tp`` mesh.
Its per-node costs are attributed to three parts: head, block (the probe's blocks averaged) and
tail, so every stage kind (``k`` blocks, with or without either end) is priced from them
without another solve; identical stages share everything.

Within a stage the ``dp`` axis is data parallel (the microbatch split over it, parameters
replicated, gradients all-reduced once per step; Megatron's and Mist's convention for the
outer axes), priced here with the same formulas the ILP uses (``CommPricer.grad_sync_s``,
``cost_models.training_state_bytes``, one all-gather per microbatch under ZeRO-3). For each
stage the cheapest option that fits the memory budget with its in-flight activations is kept,
over: the probe's layouts (the ILP's budget-free optimum, or ``megatron``'s layouts), ZeRO
stage 0, 2 or 3 on ``dp`` (1 is never better than 2 under the cost model), and the number of
blocks recomputed whole in backward (as the ILP's integer counts over tied layers do).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.mesh import Mesh
from autopar.planner.configurations import Solved
from autopar.planner.pipeline_schedule import StageCost
from autopar.planner.pricing import CommPricer
from autopar.planner.sibling_grads import shared_grad_saving
from autopar.planner.space import StrategySpace, local_bytes
from autopar.planner.tying import block_of
from autopar.strategies import input_nodes
from autopar.strategies.registry import tensor_meta
from cost_models import LinkSpec, collective_time_s, send_time_s, training_state_bytes
from cost_models.hardware import get_device

ZERO_STAGES = (0, 2, 3)


@dataclass(kw_only=True, slots=True)
class Part:
    """One part (head, one block, tail) of a probe under its chosen layouts, per device."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    weight_s: float = 0.0
    """The parameter-gradient products in ``backward_s`` (:func:`weight_shares`)."""
    tp_sync_s: float = 0.0
    """Parameter-gradient all-reduces on the tp axis (once per step)."""
    params: list[tuple[float, int]] = field(default_factory=list)
    """(local elements after tp sharding, itemsize) per parameter."""
    activation_bytes: float = 0.0
    transient_bytes: float = 0.0
    fixed_bytes: float = 0.0
    recompute_s: float = 0.0
    """Forward seconds of recomputing the part (blocks only)."""
    boundary_bytes: float = 0.0
    """Blocks: the activations entering a block (kept when it is recomputed, sent between
    stages)."""

    def scaled(self, factor: float) -> Part:
        return Part(
            forward_s=self.forward_s * factor,
            backward_s=self.backward_s * factor,
            weight_s=self.weight_s * factor,
            tp_sync_s=self.tp_sync_s * factor,
            activation_bytes=self.activation_bytes * factor,
            transient_bytes=self.transient_bytes,
            fixed_bytes=self.fixed_bytes * factor,
            recompute_s=self.recompute_s * factor,
            boundary_bytes=self.boundary_bytes,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Parts:
    """A probe's head, average block and tail, and the layouts they came from."""

    head: Part
    block: Part
    tail: Part
    layouts: str
    """"auto" (the ILP's optimum) or a recipe's name."""
    num_probe_blocks: int


def _part_names(space: StrategySpace) -> tuple[dict[str, str], int]:
    """Space node name -> "head", "tail" or "block:<i>", and the number of blocks."""
    gm = space.captured.gm
    order = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    block_index: dict[str, int] = {}
    for node in gm.graph.nodes:
        found = block_of(node)
        if found is not None and node.name in space.index:
            block_index[node.name] = found[1]
    first_block_op = min(
        (order[n] for n in block_index if space.node(n).kind == "op"), default=len(order)
    )
    by_name = {n.name: n for n in gm.graph.nodes}
    out: dict[str, str] = {}
    for name in space.index:
        if name in block_index:
            out[name] = f"block:{block_index[name]}"
            continue
        node = by_name[name]
        where = order[name]
        if node.op == "placeholder":
            users = [order[u.name] for u in node.users]
            where = min(users, default=where)
        out[name] = "head" if where < first_block_op else "tail"
    blocks = sorted({int(p.split(":")[1]) for p in out.values() if p.startswith("block:")})
    return out, len(blocks)


def probe_parts(space: StrategySpace, solved: Solved, *, layouts: str) -> Parts:
    """Attribute a solved probe's per-node costs to head, average block and tail."""
    names, num_blocks = _part_names(space)
    if num_blocks == 0:
        raise ValueError(
            "the model has no stack of repeated blocks (module paths like layers.0, h.0, "
            "blocks.0): pipeline stages cut only between blocks; plan it without stages"
        )
    parts: dict[str, Part] = {"head": Part(), "tail": Part(), "block": Part()}
    choice = solved.choice
    shares = weight_shares(space)
    shared = shared_grad_saving(space.sibling_grads, choice)  # one all-reduce per conversion
    for i, node in enumerate(space.nodes):
        key = names[node.name]
        part = parts["block" if key.startswith("block") else key]
        s = choice[i]
        fwd = float(node.forward_s[s]) if node.forward_s is not None else 0.0
        comm = float(node.output_comm_s[s])
        part.forward_s += fwd + comm / 2
        grad_comm = float(node.grad_comm_s[s]) - shared.get(i, 0.0)
        part.backward_s += float(node.compute_s[s]) - fwd + grad_comm + comm / 2
        part.weight_s += (float(node.compute_s[s]) - fwd) * shares.get(node.name, 0.0)
        part.tp_sync_s += float(node.param_grad_comm_s[s])
        part.activation_bytes += float(node.activation_bytes[s])
        part.fixed_bytes += float(node.fixed_bytes[s])
        part.transient_bytes = max(part.transient_bytes, float(node.transient_bytes[s]))
        if key.startswith("block"):
            part.recompute_s += fwd
        if node.kind == "param" and node.alias_of is None and node.local_numel is not None:
            part.params.append((float(node.local_numel[s]), node.itemsize))
    for edge in space.edges:
        cost = float(edge.cost_s[choice[edge.src], choice[edge.dst]])
        key = names[space.nodes[edge.dst].name]
        part = parts["block" if key.startswith("block") else key]
        part.forward_s += cost / 2
        part.backward_s += cost / 2
    block = parts["block"].scaled(1.0 / num_blocks)
    # Tied blocks have the same parameters: the average block owns one block's.
    block.params = parts["block"].params[: len(parts["block"].params) // num_blocks]
    block.boundary_bytes = _boundary_bytes(space, solved, names, num_blocks)
    return Parts(
        head=parts["head"],
        block=block,
        tail=parts["tail"],
        layouts=layouts,
        num_probe_blocks=num_blocks,
    )


def weight_shares(space: StrategySpace) -> dict[str, float]:
    """Per op node, the share of its backward computation that is parameter gradients (what
    a split backward's weight pass computes; planner.split_schedules): a matrix product with a
    weight operand (one fed only by parameters: a weight, its transpose or cast) computes dX
    and dW, two products of the forward's size (cost_models' backward factor), so 1/2; an
    embedding lookup's backward is its weight's gradient alone, 1; every other op's backward
    is input gradients (a norm's or a bias's parameter gradient is a column sum, counted
    there)."""
    from autopar.capture.flops import op_family

    params = {n.name for n in space.nodes if n.kind == "param"}
    weight_only: set[str] = set()
    shares: dict[str, float] = {}
    for node in space.captured.gm.graph.nodes:
        inputs = [a.name for a in node.all_input_nodes]
        if node.name in params or (
            node.op == "call_function" and inputs and all(a in weight_only for a in inputs)
        ):
            weight_only.add(node.name)
            continue
        if node.op != "call_function" or not any(a in weight_only for a in inputs):
            continue
        family = op_family(node.target)
        if family in ("matmul", "convolution"):
            shares[node.name] = 0.5
        elif family == "embedding":
            shares[node.name] = 1.0
    return shares


def _boundary_bytes(
    space: StrategySpace, solved: Solved, names: dict[str, str], num_blocks: int
) -> float:
    """Local bytes of the activations the last probe block takes from outside itself (the
    residual stream and what the head computed once, such as rotary tables)."""
    last = f"block:{num_blocks - 1}"
    gm = space.captured.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    act_scale = 0.5 if space.options.mixed_precision else 1.0
    seen: set[str] = set()
    total = 0.0
    for name, part in names.items():
        if part != last or space.node(name).kind != "op":
            continue
        for inp in input_nodes(by_name[name]):
            if inp.name in seen or names.get(inp.name) == last or inp.op == "placeholder":
                continue
            if inp.name not in space.index:
                continue
            seen.add(inp.name)
            producer = space.node(inp.name)
            strategy = producer.strategies[solved.choice[space.index[inp.name]]]
            meta = tensor_meta(inp.meta["val"])
            if isinstance(meta, list):
                continue
            placement = strategy.outputs[0] if strategy.outputs else None
            nbytes = local_bytes(meta, placement, space.mesh.shape)
            total += nbytes * (act_scale if meta.dtype.is_floating_point else 1.0)
    return total


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePricer:
    """Prices stage kinds on a ``dp x tp`` submesh from probes' :class:`Parts`.

    Args:
        options: the probe layouts to choose from (auto, and megatron's for the baseline).
        dp: data-parallel ranks of the stage; ``dp_link`` their link.
        pp_link: the link between consecutive stages.
        optimizer, mixed_precision: what the state bytes count.
        budget: bytes per device.
        zero_stages: ZeRO stages on ``dp`` to weigh.
        recompute: whether blocks may be recomputed to fit.
    """

    options: tuple[Parts, ...]
    dp: int
    dp_link: LinkSpec
    pp_link: LinkSpec
    optimizer: str
    mixed_precision: str | None
    budget: float
    zero_stages: tuple[int, ...] = ZERO_STAGES
    recompute: bool = True
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    """Per (part, ZeRO stage): its state bytes and communication (parts are shared)."""

    def price(
        self,
        *,
        blocks: int,
        first: bool,
        last: bool,
        in_flight: int,
        microbatches: int,
        reserve_bytes: float = 0.0,
    ) -> StageCost | None:
        """The fastest way to run this stage kind that fits the budget, or None.
        ``reserve_bytes``: what the other stages on the same rank hold at rest (their state,
        inputs and buffers; schedules with 2 stages per rank), kept out of the budget and
        counted in the memory as ``other_stages``."""
        best: StageCost | None = None
        for parts in self.options:
            for zero in self.zero_stages if self.dp > 1 else (0,):
                cost = self._price_one(
                    parts,
                    zero,
                    blocks=blocks,
                    first=first,
                    last=last,
                    in_flight=in_flight,
                    reserve_bytes=reserve_bytes,
                )
                if cost is None:
                    continue
                total = cost.time_s * microbatches + cost.step_s
                if best is None or total < best.time_s * microbatches + best.step_s - 1e-15:
                    best = cost
        return best

    def _price_one(
        self,
        parts: Parts,
        zero: int,
        *,
        blocks: int,
        first: bool,
        last: bool,
        in_flight: int,
        reserve_bytes: float = 0.0,
    ) -> StageCost | None:
        chosen = [(parts.block, blocks)]
        if first:
            chosen.append((parts.head, 1))
        if last:
            chosen.append((parts.tail, 1))
        forward = sum(p.forward_s * n for p, n in chosen)
        backward = sum(p.backward_s * n for p, n in chosen)
        weight = sum(p.weight_s * n for p, n in chosen)
        activations = sum(p.activation_bytes * n for p, n in chosen)
        fixed = sum(p.fixed_bytes * n for p, n in chosen)
        transient = max(p.transient_bytes for p, _ in chosen)
        state, gather_s, sync_s = self._state(chosen, zero)
        sync_s += sum(p.tp_sync_s * n for p, n in chosen)
        boundary = parts.block.boundary_bytes
        if not first:
            fixed += boundary  # the received activation
        fixed_total = state + fixed + transient + reserve_bytes
        saving = (parts.block.activation_bytes - boundary) * in_flight
        recomputed = 0
        over = fixed_total + activations * in_flight - self.budget
        if over > 0:
            if not self.recompute or saving <= 0:
                return None
            # Recomputing r blocks saves r * saving, and backward holds one block's activations
            # again while it runs.
            recomputed = -int(-(over + parts.block.activation_bytes) // saving)
            if recomputed > blocks:
                return None
            transient += parts.block.activation_bytes
        activations -= recomputed * (parts.block.activation_bytes - boundary)
        backward += recomputed * parts.block.recompute_s
        send = send_time_s(boundary, self.pp_link)
        p2p = send * ((0 if last else 1) + (0 if first else 1))
        memory = {
            "state": state,
            "activations": activations * in_flight,
            "inputs_buffers": fixed,
            "transient": transient,
        }
        if reserve_bytes:
            memory["other_stages"] = reserve_bytes
        return StageCost(
            forward_s=forward + gather_s / 2,
            backward_s=backward + gather_s / 2,
            weight_s=weight,
            p2p_s=p2p,
            step_s=sync_s,
            peak_memory_bytes=sum(memory.values()),
            memory=memory,
            detail={
                "layouts": parts.layouts,
                "zero_stage": zero,
                "recomputed_blocks": recomputed,
                "in_flight": in_flight,
                "boundary_bytes": boundary,
            },
        )

    def _state(self, chosen: list[tuple[Part, int]], zero: int) -> tuple[float, float, float]:
        """(state bytes, ZeRO-3 gather seconds per microbatch, dp gradient sync per step)."""
        totals = [0.0, 0.0, 0.0]
        for part, count in chosen:
            key = (id(part), zero)
            if key not in self.memo:
                self.memo[key] = self._part_state(part, zero)
            for k, value in enumerate(self.memo[key]):
                totals[k] += value * count
        return totals[0], totals[1], totals[2]

    def _part_state(self, part: Part, zero: int) -> tuple[float, float, float]:
        dp = self.dp
        pricer = CommPricer(
            Mesh(shape=(dp,), axis_names=("dp",), device=_ANY_DEVICE, links=(self.dp_link,)), None
        )
        state = gather = sync = 0.0
        for numel, itemsize in part.params:
            breakdown = training_state_bytes(
                num_elements=numel,
                param_dtype_bytes=itemsize,
                optimizer=self.optimizer,
                mixed_precision=self.mixed_precision,
                param_shards=dp if zero == 3 else 1,
                grad_shards=dp if zero >= 2 else 1,
                state_shards=dp if zero >= 1 else 1,
            )
            state += breakdown.total
            # Gradients are reduced in the parameters' dtype (fp32 under mixed precision: the
            # runtime reduces into the fp32 masters, as the ILP prices it); ZeRO-3 gathers the
            # compute copies (half precision under mixed precision).
            gather_itemsize = 2 if self.mixed_precision else itemsize
            if dp > 1:
                sync += pricer.grad_sync_s(numel * itemsize, 0)
                if zero == 3:
                    gather += collective_time_s(
                        "all_gather", numel * gather_itemsize, dp, self.dp_link
                    )
        return state, gather, sync


_ANY_DEVICE = get_device("cpu")
"""CommPricer needs a mesh; a dp-only mesh's device is never used for communication."""

__all__ = ["Part", "Parts", "StagePricer", "probe_parts", "weight_shares"]
