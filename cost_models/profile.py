"""The JSON profile that overrides or calibrates the device and link presets.

One schema (:data:`PROFILE_SCHEMA`) serves user overrides and calibration output; the specs it
builds are :mod:`cost_models.hardware`'s ``DeviceSpec`` and ``LinkSpec``::

    {"version": 1,
     "device": {"name": "h100-tuned", "base": "h100", "op_efficiency": {"matmul": 0.78}},
     "links": {"tp": {"base": "nvlink", "bandwidth_Bps": 3.6e11},
               "0": {"name": "ib", "bandwidth_Bps": 4.5e10, "latency_s": 8e-6}},
     "meta": {"measured_by": "autopar calibrate", "date": "2026-01-01"}}

Every field is optional except that an entry needs either a ``base`` preset or its required
numbers; ``name`` defaults to the base's name. Link keys are mesh axis names or indices.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from cost_models.hardware import (
    COLLECTIVE_KINDS,
    COMM_BACKENDS,
    MAX_OP_EFFICIENCY,
    DeviceSpec,
    FrozenMap,
    LinkSpec,
    backend_fields,
)

__all__ = ["PROFILE_SCHEMA", "PROFILE_VERSION", "Profile", "load_profile", "save_profile"]

PROFILE_VERSION = 1


_POSITIVE = {"type": "number", "exclusiveMinimum": 0}
_NONNEGATIVE = {"type": "number", "minimum": 0}

_PAIR_PER_KIND = {
    "type": "object",
    "propertyNames": {"enum": list(COLLECTIVE_KINDS)},
    "additionalProperties": {"type": "array", "items": _NONNEGATIVE, "minItems": 2, "maxItems": 2},
}
"""Two numbers per collective kind: a link's ``collectives`` (alpha, beta) and ``smallest``
(bytes, seconds)."""
_FRACTION = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
_TEXT = {"type": "string", "minLength": 1}

PROFILE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "autopar hardware profile",
    "type": "object",
    "required": ["version"],
    "additionalProperties": False,
    "properties": {
        "version": {"const": PROFILE_VERSION},
        "device": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "name": _TEXT,
                "base": _TEXT,
                "peak_flops": {"type": "object", "additionalProperties": _POSITIVE},
                "mem_bandwidth_Bps": _POSITIVE,
                "mem_capacity_bytes": _POSITIVE,
                "matmul_efficiency": _FRACTION,
                "memory_efficiency": _FRACTION,
                "kernel_overhead_s": _NONNEGATIVE,
                "op_efficiency": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "number",
                        "exclusiveMinimum": 0,
                        "maximum": MAX_OP_EFFICIENCY,
                    },
                },
                "busy_rank_speed": {
                    "type": "object",
                    "propertyNames": {"pattern": "^[1-9][0-9]*$"},
                    "additionalProperties": _POSITIVE,
                },
                "step_error": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
                "paired_error": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
                "task_wait_s": _NONNEGATIVE,
                "core_wait_s": {
                    "type": "object",
                    "propertyNames": {"pattern": "^[1-9][0-9]*$"},
                    "additionalProperties": _NONNEGATIVE,
                },
                "task_gap_s": {"type": "array", "items": _NONNEGATIVE},
                "task_gap_by_others_s": {
                    "type": "object",
                    "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": {"type": "array", "items": _NONNEGATIVE},
                },
                "comm_backend": {"enum": list(COMM_BACKENDS)},
                "collectives_overlap_compute": {"type": "boolean"},
                "source": {"type": "string"},
            },
            "anyOf": [
                {"required": ["base"]},
                {"required": ["name", "peak_flops", "mem_bandwidth_Bps", "mem_capacity_bytes"]},
            ],
        },
        "links": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "name": _TEXT,
                    "base": _TEXT,
                    "bandwidth_Bps": _POSITIVE,
                    "latency_s": _NONNEGATIVE,
                    "sync_s": _NONNEGATIVE,
                    "collectives": _PAIR_PER_KIND,
                    "smallest": _PAIR_PER_KIND,
                    "small_messages": {
                        "type": "object",
                        "propertyNames": {"enum": list(COLLECTIVE_KINDS)},
                        "additionalProperties": {
                            "type": "array",
                            "minItems": 1,
                            "items": _PAIR_PER_KIND["additionalProperties"],
                        },
                    },
                    "cpu_collectives": _PAIR_PER_KIND,
                    "cpu_weight": _NONNEGATIVE,
                    "source": {"type": "string"},
                },
                "anyOf": [
                    {"required": ["base"]},
                    {"required": ["name", "bandwidth_Bps", "latency_s"]},
                ],
            },
        },
        "meta": {"type": "object"},
    },
}

_ANYOF_HINTS = {
    "device": "the device needs a 'base' preset or all of name, peak_flops, mem_bandwidth_Bps, "
    "mem_capacity_bytes",
    "links": "each link needs a 'base' preset or all of name, bandwidth_Bps, latency_s",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """A device and per-axis links that override presets (a user file or a calibration)."""

    device: DeviceSpec | None = None
    links: Mapping[str, LinkSpec] = field(default_factory=FrozenMap)
    """Keyed by mesh axis name or axis index (as a decimal string)."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Free-form JSON: who measured, when, on what."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", FrozenMap({str(k): v for k, v in self.links.items()}))
        object.__setattr__(self, "meta", copy.deepcopy(dict(self.meta)))

    def to_dict(self) -> dict[str, Any]:
        """The profile JSON (every field written out, no ``base``), valid under the schema."""
        d: dict[str, Any] = {"version": PROFILE_VERSION}
        if self.device is not None:
            d["device"] = self.device.to_dict()
        d["links"] = {k: v.to_dict() for k, v in self.links.items()}
        d["meta"] = copy.deepcopy(dict(self.meta))
        return d


def _describe_error(err: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in err.absolute_path) or "<top>"
    if err.validator == "anyOf":
        hint = _ANYOF_HINTS.get(str(err.absolute_path[0]) if err.absolute_path else "", "")
        return f"at {where}: {hint or err.message}"
    return f"at {where}: {err.message}"


def load_profile(path_or_dict: str | os.PathLike[str] | Mapping[str, Any] | Profile) -> Profile:
    """Read and validate a profile (a JSON file path, an already-parsed dict, or a Profile).

    Raises:
        ValueError: the JSON is malformed or violates ``PROFILE_SCHEMA`` (all violations listed).
    """
    if isinstance(path_or_dict, Profile):
        return path_or_dict
    where = "profile"
    if isinstance(path_or_dict, Mapping):
        data: Any = path_or_dict
    else:
        where = f"profile {os.fspath(path_or_dict)!r}"
        with open(path_or_dict, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where} is not valid JSON: {exc}") from exc
    validator = jsonschema.Draft202012Validator(PROFILE_SCHEMA)
    errors = sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        detail = "; ".join(_describe_error(e) for e in errors)
        raise ValueError(f"invalid {where}: {detail} (see cost_models.PROFILE_SCHEMA)")
    device_data = data.get("device")
    backend = data.get("meta", {}).get("backend")
    if device_data is not None and "comm_backend" not in device_data and backend == "gloo":
        # A calibration made before DeviceSpec.comm_backend existed: its meta names the backend.
        device_data = {**device_data, **backend_fields(backend)}
    try:
        device = DeviceSpec.from_dict(device_data) if device_data is not None else None
        links = {k: LinkSpec.from_dict(v) for k, v in data.get("links", {}).items()}
    except ValueError as exc:
        raise ValueError(f"invalid {where}: {exc}") from exc
    return Profile(device=device, links=links, meta=data.get("meta", {}))


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write ``profile`` as JSON; ``load_profile`` of the file returns an equal Profile."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_dict(), f, indent=2)
        f.write("\n")
