"""Plan: the solver's answer in user terms, as versioned JSON, with summary() and explain().

A Plan is a JSON document (see ``schema.json`` beside this file, validated on load) plus,
when it was made in this process, the live objects behind it (the captured graph and the
strategy space) so ``explain`` can show the alternatives the solver weighed.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jsonschema

from autopar.errors import PlanMismatchError
from autopar.options import format_bytes, format_seconds
from autopar.placement import format_placements, parse_placements
from autopar.planner.checkpointing import CheckpointSegment
from autopar.strategies import Strategy

PLAN_VERSION = 1


def zero_label(entry: dict[str, Any]) -> str:
    """'stage 3 on dp,tp', or 'stages dp=2,tp=3' when the axes differ, of a plan JSON ``zero``
    entry (or a ``zero.considered`` row); plans without ``stages`` read as stage on axes."""
    stages = entry.get("stages") or {}
    if len({v for v in stages.values() if v}) > 1:
        return "stages " + ",".join(f"{name}={v}" for name, v in stages.items())
    return f"stage {entry['stage']}" + (f" on {','.join(entry['axes'])}" if entry["axes"] else "")


def _per_stage_key(entry: dict[str, Any]) -> str:
    """The chosen configuration's key in ``zero.per_stage`` (see autopar.plan.build._per_stage)."""
    stages = entry.get("stages") or {}
    if len({v for v in stages.values() if v}) > 1:
        return ",".join(f"{name}={v}" for name, v in stages.items())
    return str(entry["stage"])


def plan_schema() -> dict[str, Any]:
    return json.loads(resources.files("autopar.plan").joinpath("schema.json").read_text())


def _placements_or_none(text: str | None):
    return None if text is None else parse_placements(text)


def block_of(module_path: str) -> str:
    """The repeated block a module path belongs to: the path up to its first numeric part
    (``layers.3.attn.q_proj`` -> ``layers.3``), else its first part, else ``(top)``."""
    if not module_path:
        return "(top)"
    parts = module_path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


@dataclass(kw_only=True)
class Plan:
    """A sharding plan. ``data`` is the JSON document; ``space`` the live strategy space
    (None after ``Plan.load``)."""

    data: dict[str, Any]
    space: Any = field(default=None, repr=False)
    choice: tuple[int, ...] | None = field(default=None, repr=False)

    # ---------------------------------------------------------------- accessors
    @property
    def graph_hash(self) -> str:
        return self.data["model"]["graph_hash"]

    @property
    def recipe(self) -> str:
        return self.data["recipe"]

    @property
    def predicted_step_s(self) -> float:
        return self.data["predicted"]["step_s"]

    @property
    def predicted_peak_memory_bytes(self) -> float:
        return self.data["predicted"]["peak_memory_bytes"]

    @property
    def zero(self) -> dict[str, Any]:
        return self.data["zero"]

    @property
    def warnings(self) -> list[str]:
        return self.data["warnings"]

    @property
    def baselines(self) -> dict[str, Any]:
        return self.data["baselines"]

    def checkpoint_segments(self) -> tuple[CheckpointSegment, ...]:
        """Segments to recompute in backward (JSON ``checkpoint.segments``), in plan order;
        empty when nothing is recomputed. They never overlap."""
        return tuple(
            CheckpointSegment(
                module_path=seg["module_path"],
                nodes=tuple(seg["nodes"]),
                keep=tuple(seg["keep"]),
                policy=seg["policy"],
            )
            for seg in self.data.get("checkpoint", {}).get("segments", [])
        )

    def param_placements(self) -> dict[str, str]:
        return {fqn: p["placement"] for fqn, p in self.data["params"].items()}

    def node(self, name: str) -> dict[str, Any]:
        for entry in self.data["nodes"]:
            if entry["name"] == name:
                return entry
        raise KeyError(f"no node named {name!r} in this plan")

    def choices(self) -> dict[str, Strategy]:
        """Node name -> chosen Strategy, for the lowering (placeholders included)."""
        out: dict[str, Strategy] = {}
        for entry in self.data["nodes"]:
            out[entry["name"]] = Strategy(
                outputs=tuple(_placements_or_none(p) for p in entry["outputs"]),
                inputs=tuple(_placements_or_none(p) for p in entry["inputs"]),
                input_grads=tuple(_placements_or_none(p) for p in entry["input_grads"]),
            )
        return out

    def conversions(self) -> list[dict[str, Any]]:
        """Every edge whose layout changes: producer, consumer, placements, and the forward and
        backward collectives (the same steps the runtime executes)."""
        from autopar.resharding.steps import reshard_steps

        by_name = {e["name"]: e for e in self.data["nodes"]}
        mesh_shape = tuple(self.data["mesh"]["shape"])
        out = []
        for entry in self.data["nodes"]:
            for j, arg in enumerate(entry.get("args", [])):
                producer = by_name.get(arg)
                if producer is None or entry["inputs"][j] is None:
                    continue
                index = 0
                if entry["op"] == "<built-in function getitem>":
                    index = entry.get("getitem_index", 0)
                src = producer["outputs"][index]
                dst = entry["inputs"][j]
                if src is None or src == dst:
                    continue
                shape = producer["shapes"][index]
                fwd, bwd = reshard_steps(parse_placements(src), parse_placements(dst), shape, 4, mesh_shape)
                out.append(
                    {
                        "producer": arg,
                        "consumer": entry["name"],
                        "src": src,
                        "dst": dst,
                        "forward": [s.kind for s in fwd],
                        "backward": [s.kind for s in bwd],
                    }
                )
        return out

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> str:
        return json.dumps(self.data, indent=1, sort_keys=True)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def from_json(cls, text: str, *, expected_hash: str | None = None) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a plan file (invalid JSON: {e})") from None
        return cls.from_dict(data, expected_hash=expected_hash)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, expected_hash: str | None = None) -> Plan:
        if isinstance(data, dict) and data.get("version") not in (None, PLAN_VERSION):
            raise ValueError(
                f"plan version {data.get('version')} is not supported by this autopar "
                f"(reads version {PLAN_VERSION}); re-plan with this version"
            )
        try:
            jsonschema.validate(data, plan_schema())
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "(top)"
            raise ValueError(f"invalid plan file at {where}: {e.message}") from None
        if expected_hash is not None and data["model"]["graph_hash"] != expected_hash:
            raise PlanMismatchError(
                f"this plan was made for another model or input shapes (plan graph hash "
                f"{data['model']['graph_hash'][:12]}..., model '{data['model']['name']}'; this "
                f"model's graph hash is {expected_hash[:12]}...): re-plan for this model with "
                f"autopar.plan(...) or `autopar plan`"
            )
        return cls(data=data)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, expected_hash: str | None = None) -> Plan:
        """Read a plan file; with ``expected_hash`` refuse a plan made for another graph."""
        with open(path) as f:
            return cls.from_json(f.read(), expected_hash=expected_hash)

    # ---------------------------------------------------------------- reports
    def summary(self, *, width: int = 140) -> str:
        """Plain-text report: totals, the recipes side by side, and a table per layer block."""
        from rich.console import Console
        from rich.table import Table

        console = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)
        d = self.data
        mesh = d["mesh"]
        axes = " x ".join(f"{n}={s}" for n, s in zip(mesh["axis_names"], mesh["shape"]))
        pred = d["predicted"]
        zero = d["zero"]
        console.print(
            f"autopar plan ({d['recipe']}) for {d['model']['name']}: "
            f"{d['model']['num_params']:,} parameters, {d['model']['num_nodes']} nodes"
        )
        console.print(f"mesh {axes} on {mesh['device']['name']}")
        console.print(
            f"predicted step {format_seconds(pred['step_s'])}, peak memory "
            f"{format_bytes(pred['peak_memory_bytes'])} of budget "
            f"{format_bytes(d['memory_budget_bytes'])}; ZeRO {zero_label(zero)}"
        )
        segments = d["checkpoint"]["segments"]
        console.print(
            f"checkpointing ({d['checkpoint'].get('mode', 'auto')}): {len(segments)} segment(s) "
            f"recomputed"
            + (
                f" ({', '.join(seg['module_path'] + ('' if seg['policy'] == 'full' else ' [selective]') for seg in segments[:6])}"
                f"{', ...' if len(segments) > 6 else ''}), "
                f"{format_bytes(sum(seg['saved_bytes'] for seg in segments))} of activations saved, "
                f"+{format_seconds(sum(seg['recompute_s'] for seg in segments))} recompute per step"
                if segments
                else ""
            )
        )
        s = d["solver"]
        console.print(
            f"solver {s['backend']}: {s['status']}, gap {s['gap']:.2%}, {s['num_variables']:,} "
            f"variables, {s['num_constraints']:,} constraints, {s['solve_s']:.2f} s"
        )
        br = Table(title="step time and memory, same cost model", title_justify="left")
        for col in ("plan", "step", "vs auto", "compute", "reshard", "grad sync", "zero comm", "peak mem", "fits"):
            br.add_column(col, justify="right" if col != "plan" else "left")
        rows = [(f"{d['recipe']} (this plan)", pred, True)]
        rows += [(name, b, b["fits"]) for name, b in d["baselines"].items() if name != d["recipe"]]
        for name, fig, fits in rows:
            bk = fig["breakdown"]
            br.add_row(
                name,
                format_seconds(fig["step_s"]),
                f"{fig['step_s'] / pred['step_s']:.2f}x" if pred["step_s"] > 0 else "-",
                format_seconds(bk["compute_s"]),
                format_seconds(bk["resharding_s"] + bk["activation_grad_comm_s"] + bk["output_comm_s"]),
                format_seconds(bk["grad_sync_s"]),
                format_seconds(bk["zero_comm_s"]),
                format_bytes(fig["peak_memory_bytes"]),
                "yes" if fits else "no",
            )
        console.print(br)
        mem = Table(title="peak memory per device: these layouts under each ZeRO stage", title_justify="left")
        mem.add_column("ZeRO stage")
        mem.add_column("step", justify="right")
        for key in pred["memory"]:
            mem.add_column(key, justify="right")
        mem.add_column("peak", justify="right")
        chosen_key = _per_stage_key(zero)
        per_stage = zero.get("per_stage") or {chosen_key: pred}
        for stage, fig in per_stage.items():
            mark = " (chosen)" if stage == chosen_key else ""
            mem.add_row(
                f"{stage}{mark}",
                format_seconds(fig["step_s"]),
                *(format_bytes(fig["memory"].get(key, 0.0)) for key in pred["memory"]),
                format_bytes(fig["peak_memory_bytes"]),
            )
        console.print(mem)
        considered = zero.get("considered")
        if considered:
            keys = list(pred["memory"])
            cfg = Table(
                title="ZeRO configurations considered (layouts: own = solved for it, chosen = "
                "this plan's priced under it)",
                title_justify="left",
            )
            for col in ("configuration", "layouts", "step", *keys, "peak", "verdict"):
                cfg.add_column(col, justify="left" if col in ("configuration", "verdict") else "right")
            for row in considered:
                memory = row.get("memory") or {}
                cfg.add_row(
                    zero_label(row),
                    row["layouts"],
                    format_seconds(row["step_s"]),
                    *(format_bytes(memory[k]) if k in memory else "-" for k in keys),
                    format_bytes(row["peak_memory_bytes"]),
                    row["verdict"],
                )
            console.print(cfg)
            console.print(f"ZeRO choice: {zero['reason']}")

        blocks: dict[str, dict[str, Any]] = defaultdict(
            lambda: {"params": [], "acts": defaultdict(int), "seconds": 0.0, "memory": 0.0, "nodes": 0}
        )
        for entry in d["nodes"]:
            blk = blocks[block_of(entry["module_path"])]
            blk["nodes"] += 1
            blk["seconds"] += entry["seconds"]
            blk["memory"] += entry["memory_bytes"]
            if entry["kind"] == "op" and entry["outputs"] and entry["outputs"][0] is not None:
                blk["acts"][entry["outputs"][0]] += 1
        for fqn, p in d["params"].items():
            block = block_of(p["module_path"])
            name = fqn[len(block) + 1 :] if fqn.startswith(block + ".") else fqn
            blocks[block]["params"].append(f"{name}={p['placement']}")
        table = Table(title="per layer block", title_justify="left", show_lines=True)
        table.add_column("block")
        table.add_column("parameters (placement per mesh axis)", overflow="fold", max_width=60)
        table.add_column("activations (count)", overflow="fold", max_width=30)
        table.add_column("time", justify="right")
        table.add_column("memory", justify="right")
        for name, blk in sorted(blocks.items(), key=lambda kv: _natural_key(kv[0])):
            acts = ", ".join(f"{p} x{c}" for p, c in sorted(blk["acts"].items(), key=lambda kv: -kv[1]))
            table.add_row(
                name,
                " ".join(blk["params"]) or "-",
                acts or "-",
                format_seconds(blk["seconds"]),
                format_bytes(blk["memory"]),
            )
        console.print(table)
        if d["warnings"]:
            console.print("warnings:")
            for w in d["warnings"]:
                console.print(f"  - {w}")
        return console.export_text()

    def explain(self, node: str) -> str:
        """Why ``node`` (a node name or a parameter FQN) got its layout: its chosen strategy,
        costs, and (for a plan made in this process) the cheapest alternatives."""
        d = self.data
        entry = next((e for e in d["nodes"] if e["name"] == node or e.get("fqn") == node), None)
        if entry is None:
            close = [e["name"] for e in d["nodes"] if node in e["name"] or node in (e.get("fqn") or "")]
            raise KeyError(
                f"no node or parameter {node!r} in this plan" + (f"; did you mean {close[:5]}?" if close else "")
            )
        lines = [
            f"node {entry['name']} ({entry['op']}) in module '{entry['module_path'] or '(top)'}'"
            + (f", parameter {entry['fqn']}" if entry.get("fqn") else ""),
            f"  chosen: inputs [{' '.join(str(p) for p in entry['inputs'])}] -> outputs "
            f"[{' '.join(str(p) for p in entry['outputs'])}]",
            f"  input gradients: [{' '.join(str(p) for p in entry['input_grads'])}]",
            f"  cost: {format_seconds(entry['seconds'])} (compute {format_seconds(entry['compute_s'])}, "
            f"communication {format_seconds(entry['seconds'] - entry['compute_s'])}), "
            f"memory {format_bytes(entry['memory_bytes'])}",
        ]
        if self.space is not None and self.choice is not None:
            lines.extend(self._alternatives(entry["name"]))
        else:
            lines.append("  (alternatives are shown for plans made in this process, not loaded ones)")
        return "\n".join(lines)

    def _alternatives(self, name: str, limit: int = 6) -> list[str]:
        from autopar.planner.problem import ZeroConfig, node_cost_vector

        space = self.space
        i = space.index[name]
        node = space.nodes[i]
        zero = ZeroConfig.from_json(self.data["zero"], space.mesh.axis_names)
        own_s, memory = node_cost_vector(space, node, zero)
        totals = []
        for s in range(len(node.strategies)):
            edge_s = 0.0
            for edge in space.edges:
                if edge.dst == i:
                    edge_s += float(edge.cost_s[self.choice[edge.src], s])
                elif edge.src == i:
                    edge_s += float(edge.cost_s[s, self.choice[edge.dst]])
            totals.append((float(own_s[s]) + edge_s, s, float(own_s[s]), edge_s, float(memory[s])))
        totals.sort()
        chosen = self.choice[i]
        lines = [
            f"  {len(node.strategies)} strategies; with neighbours fixed, the cheapest are "
            "(own cost + resharding to/from neighbours):"
        ]
        for total, s, own, edge_s, mem in totals[:limit]:
            mark = "*" if s == chosen else " "
            lines.append(
                f"   {mark} {node.strategies[s].describe():40s} total {format_seconds(total):>10s} "
                f"own {format_seconds(own):>10s} reshard {format_seconds(edge_s):>10s} "
                f"mem {format_bytes(mem)}"
            )
        if chosen not in [t[1] for t in totals[:limit]]:
            lines.append(
                "   (the chosen strategy is not locally cheapest: the memory budget or a neighbour's "
                "choice further away made it worth it)"
            )
        return lines


def _natural_key(text: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def strategy_entry(strategy: Strategy) -> dict[str, list[str | None]]:
    def fmt(p):
        return None if p is None else format_placements(p)

    return {
        "outputs": [fmt(p) for p in strategy.outputs],
        "inputs": [fmt(p) for p in strategy.inputs],
        "input_grads": [fmt(p) for p in strategy.input_grads],
    }
