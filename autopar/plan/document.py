"""Plan: the solver's answer in user terms, as versioned JSON, with summary() and explain().

A Plan is a JSON document (see ``schema.json`` beside this file, validated on load) plus,
when it was made in this process, the live objects behind it (the captured graph and the
strategy space) so ``explain`` can show the alternatives the solver weighed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jsonschema

from autopar.errors import PlanMismatchError
from autopar.placement import format_placements, parse_placements
from autopar.planner.checkpointing import CheckpointSegment
from autopar.planner.stages import PipelinePlan
from autopar.strategies import Strategy

PLAN_VERSION = 2
"""2: the optional ``pipeline`` entry (pipeline stages) and ``stage_search`` (the ranked table
of the stage search). Version 1 plans (no stages) load unchanged."""
READABLE_VERSIONS = (1, 2)


def plan_schema() -> dict[str, Any]:
    return json.loads(resources.files("autopar.plan").joinpath("schema.json").read_text())


def _placements_or_none(text: str | None):
    return None if text is None else parse_placements(text)


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

    @property
    def pipeline(self) -> PipelinePlan | None:
        """The pipeline stages (JSON ``pipeline``), or None for a plan without stages."""
        entry = self.data.get("pipeline")
        return None if entry is None else PipelinePlan.from_json(entry)

    def check_world_size(self, world_size: int) -> None:
        """Refuse to run this plan on a job of another size (one line, with the fix).

        Raises:
            ValueError: ``world_size`` is not the number of devices of the plan's mesh.
        """
        shape = self.data["mesh"]["shape"]
        needed = math.prod(shape)
        if world_size != needed:
            stages = self.pipeline
            what = (
                f"a pipelined plan ({stages.num_stages} stages on mesh {'x'.join(map(str, shape))})"
                if stages is not None
                else f"a plan for mesh {'x'.join(map(str, shape))}"
            )
            raise ValueError(
                f"{what} needs {needed} ranks but the job has {world_size}: launch {needed} "
                f"ranks or re-plan for {world_size} devices"
            )

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
                fwd, bwd = reshard_steps(
                    parse_placements(src), parse_placements(dst), shape, 4, mesh_shape
                )
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
        if isinstance(data, dict) and data.get("version") not in (None, *READABLE_VERSIONS):
            raise ValueError(
                f"plan version {data.get('version')} is not supported by this autopar "
                f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); re-plan with this "
                f"version"
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
    def summary(self, *, width: int | None = None, verbose: bool = False) -> str:
        """The plan in words and figures: one sentence saying what was chosen, the headline
        figures (step, peak memory vs budget, MFU), the recipes side by side, and the layouts
        per layer block in model order with a legend; ``verbose`` adds the ZeRO stage and
        configuration tables and the solver's report. ``width``: wrap and fit to this many
        columns; None gives plain unwrapped lines. Reads only the JSON, so a loaded plan
        summarises exactly like the live one (data: :func:`autopar.plan.summary.summary_data`)."""
        from autopar.plan.pipeline_summary import pipeline_summary, search_table
        from autopar.plan.render import render_summary
        from autopar.plan.summary import summary_data

        if self.data.get("pipeline") is not None:
            return pipeline_summary(self.data)
        text = render_summary(summary_data(self.data), width=width, verbose=verbose)
        if self.data.get("stage_search"):
            text += "\n\n" + "\n".join(search_table(self.data["stage_search"]))
        return text

    def explain(self, name: str, *, width: int | None = None) -> str:
        """Why ``name`` (a parameter FQN, a module path, or a graph node name) got its layout:
        the chosen placements and costs, and the alternatives the solver weighed with their
        step-time and memory deltas and why each was not chosen (stored in the plan file).

        Raises:
            KeyError: an unknown name (the message suggests FQNs and module paths).
        """
        from autopar.plan.explain import explain_text

        return explain_text(self.data, name, live=self._live_alternatives, width=width)

    def _live_alternatives(self, name: str) -> dict[str, Any] | None:
        """A node's alternatives from the live strategy space (nodes the file does not store)."""
        if self.space is None or self.choice is None or name not in self.space.index:
            return None
        from autopar.plan.alternatives import node_alternatives, recipe_allowed
        from autopar.planner.problem import ZeroConfig

        zero = ZeroConfig.from_json(self.data["zero"], self.space.mesh.axis_names)
        headroom = self.data["memory_budget_bytes"] - self.data["predicted"]["peak_memory_bytes"]
        return node_alternatives(
            self.space,
            self.choice,
            zero,
            self.space.index[name],
            headroom_bytes=headroom,
            allowed=recipe_allowed(self.space, self.recipe),
            recipe=self.recipe,
        )


def strategy_entry(strategy: Strategy) -> dict[str, list[str | None]]:
    def fmt(p):
        return None if p is None else format_placements(p)

    return {
        "outputs": [fmt(p) for p in strategy.outputs],
        "inputs": [fmt(p) for p in strategy.inputs],
        "input_grads": [fmt(p) for p in strategy.input_grads],
    }
