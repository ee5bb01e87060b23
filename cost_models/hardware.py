"""Devices and links as the cost models see them, and their datasheet presets.

A ``DeviceSpec`` is what the compute model needs to price an op (peak FLOP/s per dtype, memory
bandwidth, efficiencies, launch overhead); a ``LinkSpec`` is what the communication model needs to
price a collective on one mesh axis (bandwidth per direction, latency, optional calibrated
alpha-beta per collective). Presets carry the dense (non-sparsity) datasheet figures and name the
datasheet in ``source``.

Memory capacities are the marketed "GB" figures read as GiB (HBM stacks are power-of-two sized;
``nvidia-smi`` reports e.g. 81,920 MiB for an A100 80GB); bandwidths are decimal, as datasheets
print them. Usable capacity is a little lower (driver and allocator reserve), which a memory budget
should leave room for.

The JSON profile that overrides or calibrates these specs is :mod:`cost_models.profile`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from cost_models.spec_tables import (
    FrozenMap,
    check_fraction,
    count_table,
    measured_points,
    pair_table,
    quantile_table,
    quantiles_by_count,
)

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
COMM_BACKENDS = ("nccl", "gloo", "xccl", "hccl", "mpi")
"""``torch.distributed`` backends a ``DeviceSpec.comm_backend`` may name."""
DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")
MAX_OP_EFFICIENCY = 8.0
"""Upper bound of a calibrated ``op_efficiency``. Above 1 means faster than the roofline built
from the calibrated copy bandwidth: on a CPU a model's activations (a few MiB) stay in cache while
the bandwidth is measured on copies of 16-64 MiB, so cheap elementwise ops (add, mul) run 2-4x
faster than that roofline (README "Pipeline cost model, predicted vs measured")."""
_GiB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One accelerator (or CPU) as the compute and memory models see it."""

    name: str
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per dtype name ("float32", "tf32", "bfloat16", "float16", "float8",
    "float64"); no structured-sparsity figures."""
    mem_bandwidth_Bps: float
    """Peak memory bandwidth in bytes per second."""
    mem_capacity_bytes: int
    """Device memory in bytes."""
    matmul_efficiency: float = 0.7
    """Fraction of peak FLOP/s that large matmuls and attention reach."""
    memory_efficiency: float = 0.8
    """Fraction of peak memory bandwidth that streaming kernels reach."""
    kernel_overhead_s: float = 5e-6
    """Seconds added per op launch."""
    op_efficiency: Mapping[str, float] = field(default_factory=FrozenMap)
    """Per op family: fraction of the ideal roofline reached (written by calibration); up to
    ``MAX_OP_EFFICIENCY``, above 1 where the family's data stays in cache."""
    source: str = ""
    """Where the figures come from (datasheet name and the figures used, or a calibration)."""
    busy_rank_speed: Mapping[str, float] = field(default_factory=FrozenMap)
    """Per-rank compute speed when ``k`` ranks of the job compute at once (key ``str(k)``),
    relative to the speed the other figures price (calibration's ops, every rank computing at
    once). Ranks that share cores (CPU gloo ranks) run faster when few compute, as in a
    pipeline's ramp-up; ``autopar calibrate`` measures it on CPU, its level included: the speed
    with every rank computing is how fast a pipeline's tasks ran against their price, not 1
    (session 13; older profiles have 1 there and load unchanged). Since session 25 one entry per
    count ``k = 1 .. world``: the pipeline's CPU level times ``min(1, cores / (k + g))``, ``g``
    the other processes' runnable threads calibration met. Empty (presets, GPUs): every
    rank has its own device, the speed does not depend on how many compute."""
    task_wait_s: float = 0.0
    """Seconds a pipeline rank spends per scheduled task (one microbatch's forward or backward)
    outside its compute and its send's transfer: waking up on a receive, gloo's threads and the
    schedule's Python, on ranks that share cores. ``autopar calibrate`` measures it on CPU ranks
    with a short GPipe run; the shared-cores simulation charges it after every task. 0 for
    presets and GPUs."""
    core_wait_s: Mapping[str, float] = field(default_factory=FrozenMap)
    """Ranks outnumbering the cores they share (gloo ranks on CPU): ``{cores: seconds}``, the
    cores one host's ranks share and the longest a rank whose pipeline task becomes ready while
    every core runs another rank's task waits for one (the scheduler's latency for a woken rank
    against ranks that compute; sooner when one of those tasks ends). ``autopar calibrate``
    measures it on CPU ranks (session 26); empty (presets, GPUs, older profiles): no wait."""
    task_gap_s: tuple[float, ...] = ()
    """Ranks outnumbering the cores they share: quantiles (levels ``(n + 0.5) / N``, ascending)
    of the gap between a pipeline task becoming ready and starting, measured by ``autopar
    calibrate`` on its pipeline (session 27). The gaps' spread (a long tail: waits for a core,
    gloo's threads) lengthens the step and its idle share beyond what their mean does; the
    shared-cores simulation draws each task's gap from them around the priced mean (and then
    charges no ``core_wait_s``, which they include). Empty (presets, GPUs, older profiles,
    ranks no more than the cores): the mean alone."""
    task_gap_by_others_s: Mapping[str, tuple[float, ...]] = field(default_factory=FrozenMap)
    """Ranks outnumbering the cores they share: ``task_gap_s``'s quantiles per count of the
    job's other ranks computing when a task became ready (key ``str(k)``; the largest key
    stands for it and every count above). The gaps lengthen with that count (session 29), and
    a pipeline with more microbatches than calibration's meets the longer ones more often; the
    shared-cores simulation draws each task's gap from the table of the count it simulates
    (around ``task_gap_s``'s mean, the one it prices). Empty (presets, GPUs, older profiles):
    ``task_gap_s`` for every count."""
    comm_backend: str = "nccl"
    """The ``torch.distributed`` backend the runtime's collectives use on this device ("gloo"
    on CPUs). On gloo the ZeRO refresh after an optimizer step is one broadcast per rank
    straight into each piece (gloo's all-gather stages its result in a temporary and copies it
    out; ``autopar.runtime.zero_layout.ZeroMesh.fill_flat``), elsewhere one all-gather; the
    planner prices the refresh the way it runs."""
    collectives_overlap_compute: bool = True
    """Whether a collective in flight costs the compute nothing (NCCL on a GPU: its own engine
    and link). False for gloo ranks on CPU cores, whose collectives' copies, reductions and
    transport take the cores the compute uses (measured: README "Session 10: zero1"): the
    planner then counts every collective as exposed."""
    step_error: float = 0.0
    """Relative error of a step time predicted with these figures: how much the calibrated
    quantities moved between repeated measurements (``cost_models.calibrate.fit_step_error``).
    The planner keeps the plain recipe when the auto plan's predicted gain is below it
    (``PlanOptions.auto_margin``). 0 for datasheet devices: their figures are taken as exact."""
    paired_error: float = 0.0
    """Relative error of the DIFFERENCE between two things priced with these figures: the
    standard error of the ratio of quantities the calibration timed in the same trials (the
    collective kinds at each size, compute against a collective), from the spread of their
    per-trial ratios (``cost_models.calibrate.paired_spreads``). Load that drifts over seconds
    falls on both sides of a ratio alike, so it is smaller than ``step_error``; it is what
    ``PlanOptions.auto_margin="profile"`` weighs a predicted gain against when measured. 0 for
    datasheet devices and profiles calibrated before it was measured."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("DeviceSpec needs a non-empty name")
        if not self.peak_flops:
            raise ValueError(f"device {self.name!r}: peak_flops needs at least one dtype")
        for dtype, flops in self.peak_flops.items():
            if not flops > 0:
                raise ValueError(f"device {self.name!r}: peak_flops[{dtype!r}] must be > 0")
        if not self.mem_bandwidth_Bps > 0:
            raise ValueError(f"device {self.name!r}: mem_bandwidth_Bps must be > 0")
        if not self.mem_capacity_bytes > 0:
            raise ValueError(f"device {self.name!r}: mem_capacity_bytes must be > 0")
        if self.kernel_overhead_s < 0:
            raise ValueError(f"device {self.name!r}: kernel_overhead_s must be >= 0")
        if not self.task_wait_s >= 0:
            raise ValueError(f"device {self.name!r}: task_wait_s must be >= 0")
        if self.comm_backend not in COMM_BACKENDS:
            raise ValueError(
                f"device {self.name!r}: comm_backend must be one of {', '.join(COMM_BACKENDS)}, "
                f"got {self.comm_backend!r}"
            )
        if not isinstance(self.collectives_overlap_compute, bool):
            raise ValueError(
                f"device {self.name!r}: collectives_overlap_compute must be true or false, got "
                f"{self.collectives_overlap_compute!r}"
            )
        if not 0.0 <= self.step_error < 1.0:
            raise ValueError(
                f"device {self.name!r}: step_error must be in [0, 1), got {self.step_error}"
            )
        if not 0.0 <= self.paired_error < 1.0:
            raise ValueError(
                f"device {self.name!r}: paired_error must be in [0, 1), got {self.paired_error}"
            )
        check_fraction(f"device {self.name!r}", "matmul_efficiency", self.matmul_efficiency)
        check_fraction(f"device {self.name!r}", "memory_efficiency", self.memory_efficiency)
        for family, eff in self.op_efficiency.items():
            if not 0.0 < eff <= MAX_OP_EFFICIENCY:
                raise ValueError(
                    f"device {self.name!r}: op_efficiency[{family!r}] must be in "
                    f"(0, {MAX_OP_EFFICIENCY}], got {eff}"
                )
        for name, table, what in (("busy_rank_speed", self.busy_rank_speed, "rank"),
                                  ("core_wait_s", self.core_wait_s, "core")):  # fmt: skip
            object.__setattr__(self, name, count_table(self.name, name, table, what))
        object.__setattr__(
            self, "task_gap_s", quantile_table(self.name, "task_gap_s", self.task_gap_s)
        )
        object.__setattr__(self, "task_gap_by_others_s", quantiles_by_count(
            self.name, "task_gap_by_others_s", self.task_gap_by_others_s))  # fmt: skip
        object.__setattr__(
            self, "peak_flops", FrozenMap({k: float(v) for k, v in self.peak_flops.items()})
        )
        object.__setattr__(
            self, "op_efficiency", FrozenMap({k: float(v) for k, v in self.op_efficiency.items()})
        )
        object.__setattr__(self, "mem_capacity_bytes", int(self.mem_capacity_bytes))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict with every field (``from_dict`` inverts it exactly)."""
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "mem_bandwidth_Bps": self.mem_bandwidth_Bps,
            "mem_capacity_bytes": self.mem_capacity_bytes,
            "matmul_efficiency": self.matmul_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "kernel_overhead_s": self.kernel_overhead_s,
            "op_efficiency": dict(self.op_efficiency),
            "source": self.source,
            # Written only when measured, so preset documents (and plans) stay as they were.
            **({"busy_rank_speed": dict(self.busy_rank_speed)} if self.busy_rank_speed else {}),
            **({"step_error": self.step_error} if self.step_error else {}),
            **({"task_wait_s": self.task_wait_s} if self.task_wait_s else {}),
            **({"core_wait_s": dict(self.core_wait_s)} if self.core_wait_s else {}),
            **({"task_gap_s": list(self.task_gap_s)} if self.task_gap_s else {}),
            **(
                {"task_gap_by_others_s": {k: list(v) for k, v in self.task_gap_by_others_s.items()}}
                if self.task_gap_by_others_s
                else {}
            ),
            # GPU defaults are not written (preset documents and plans stay as they were).
            **({"comm_backend": self.comm_backend} if self.comm_backend != "nccl" else {}),
            **(
                {"collectives_overlap_compute": False}
                if not self.collectives_overlap_compute
                else {}
            ),
            **({"paired_error": self.paired_error} if self.paired_error else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        """Build from a dict of fields; ``"base": "<preset>"`` starts from a preset.

        Mappings (``peak_flops``, ``op_efficiency``) given next to a base are merged into the
        base's, so a calibration can write one family without repeating the others.
        """
        return _spec_from_dict(cls, d, DEVICES, "device", ("peak_flops", "op_efficiency"))


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """The interconnect of one mesh axis as the communication model sees it."""

    name: str
    bandwidth_Bps: float
    """Unidirectional bandwidth per device in bytes per second (what one ring step sees)."""
    latency_s: float
    """Seconds per communication step (the alpha of the alpha-beta model)."""
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=FrozenMap)
    """Calibrated ``(alpha_s, beta_s_per_byte)`` per collective kind; overrides the formula."""
    smallest: Mapping[str, tuple[float, float]] = field(default_factory=FrozenMap)
    """Per calibrated kind: ``(bytes, seconds)`` at the smallest size of the fit, which the
    large sizes steer: a message up to that size costs no more (cost_models.comm)."""
    small_messages: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=FrozenMap)
    """Per calibrated kind: ``(bytes, seconds)`` timed at sizes below ``smallest``'s, bytes
    ascending. Up to ``smallest``'s size a message costs no more than the timings interpolate
    to (cost_models.comm): on 4 gloo ranks sharing 2 cores a scalar's all-reduce took 0.6-1 ms,
    a 64-byte one 6-7 ms, the line says 7 for both (README, "Session 37")."""
    source: str = ""
    sync_s: float = 0.0
    """Seconds each blocking collective costs on top of its alpha-beta time when it runs
    between computations, as in a training step: the wait for the last rank to arrive (e.g.
    ranks that share cores and are descheduled). Back-to-back timings (the alpha) miss it;
    ``autopar calibrate`` measures it. 0 for datasheet links (GPUs in lockstep)."""
    cpu_collectives: Mapping[str, tuple[float, float]] = field(default_factory=FrozenMap)
    """Per kind, the CPU seconds one rank burns in a call (gloo's threads included) as
    ``(alpha, beta)`` over ``collectives``' steps and wire bytes; ``autopar calibrate``."""
    cpu_weight: float = 0.0
    """Opt-in: step seconds per CPU second a collective burns; a collective then costs this
    times its ``cpu_collectives`` line, not wall time plus ``sync_s``. ``autopar calibrate``
    records the figure in ``meta`` only (it ordered plans worse: README "Session 30")."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("LinkSpec needs a non-empty name")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"link {self.name!r}: bandwidth_Bps must be > 0")
        if self.latency_s < 0:
            raise ValueError(f"link {self.name!r}: latency_s must be >= 0")
        if self.sync_s < 0:
            raise ValueError(f"link {self.name!r}: sync_s must be >= 0")
        for name in ("collectives", "cpu_collectives"):
            table = pair_table(self.name, name, getattr(self, name), COLLECTIVE_KINDS)
            object.__setattr__(self, name, table)
        if not self.cpu_weight >= 0 or (self.cpu_weight and not self.cpu_collectives):
            raise ValueError(f"link {self.name!r}: cpu_weight must be >= 0, and > 0 only with "
                             f"cpu_collectives, got {self.cpu_weight!r}")  # fmt: skip
        small, tables = measured_points(
            self.name, self.smallest, self.small_messages, tuple(self.collectives)
        )
        object.__setattr__(self, "smallest", small)
        object.__setattr__(self, "small_messages", tables)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (``from_dict`` inverts it exactly); ``sync_s`` and the CPU fields
        only where set (plans made with datasheet links keep their JSON)."""
        d: dict[str, Any] = {
            "name": self.name,
            "bandwidth_Bps": self.bandwidth_Bps,
            "latency_s": self.latency_s,
            "collectives": {k: list(v) for k, v in self.collectives.items()},
            "source": self.source,
        }
        if self.sync_s:
            d["sync_s"] = self.sync_s
        if self.smallest:
            d["smallest"] = {k: list(v) for k, v in self.smallest.items()}
        if self.small_messages:
            d["small_messages"] = {k: [list(p) for p in v] for k, v in self.small_messages.items()}
        if self.cpu_collectives:
            d["cpu_collectives"] = {k: list(v) for k, v in self.cpu_collectives.items()}
        if self.cpu_weight:
            d["cpu_weight"] = self.cpu_weight
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkSpec:
        """Build from a dict of fields; ``"base": "<preset>"`` starts from a preset."""
        merged = ("collectives", "smallest", "small_messages", "cpu_collectives")
        return _spec_from_dict(cls, d, LINKS, "link", merged)


_Spec = TypeVar("_Spec", "DeviceSpec", "LinkSpec")


def _spec_from_dict(
    cls: type[_Spec],
    d: Mapping[str, Any],
    presets: Mapping[str, _Spec],
    what: str,
    merged: tuple[str, ...],
) -> _Spec:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names - {"base"})
    if unknown:
        raise ValueError(f"unknown {what} field(s) {unknown}; known: {sorted(names)} and 'base'")
    values: dict[str, Any] = {}
    if "base" in d:
        base = _lookup(d["base"], presets, what)
        values = {f.name: getattr(base, f.name) for f in fields(cls)}
        changed = sorted(set(d) - {"base", "name", "source"})
        if changed and "source" not in d:
            # The datasheet no longer describes every figure: say which ones differ.
            values["source"] = f"{base.name} preset with {', '.join(changed)} overridden"
    for key, value in d.items():
        if key == "base":
            continue
        if key in merged and "base" in d:
            value = {**values[key], **value}
        values[key] = value
    missing = sorted(f.name for f in fields(cls) if f.name not in values and f.name in _REQUIRED)
    if missing:
        raise ValueError(f"{what} {d.get('name', '?')!r} misses {missing}; give them or a 'base'")
    return cls(**values)


_REQUIRED = frozenset(
    {"name", "peak_flops", "mem_bandwidth_Bps", "mem_capacity_bytes", "bandwidth_Bps", "latency_s"}
)


def _lookup(name: str, presets: Mapping[str, _Spec], what: str) -> _Spec:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in presets:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(presets))}")
    return presets[key]


_A100_SRC = "NVIDIA A100 Tensor Core GPU datasheet"
_H100_SRC = "NVIDIA H100 Tensor Core GPU datasheet"
_H200_SRC = "NVIDIA H200 Tensor Core GPU datasheet"
_T = 1e12

_A100_FLOPS = {"float64": 19.5 * _T, "float32": 19.5 * _T, "tf32": 156 * _T,
               "bfloat16": 312 * _T, "float16": 312 * _T}  # fmt: skip
_H100_SXM_FLOPS = {"float64": 67 * _T, "float32": 67 * _T, "tf32": 494.5 * _T,
                   "bfloat16": 989.5 * _T, "float16": 989.5 * _T, "float8": 1979 * _T}  # fmt: skip
_H100_PCIE_FLOPS = {"float64": 51 * _T, "float32": 51 * _T, "tf32": 378 * _T,
                    "bfloat16": 756 * _T, "float16": 756 * _T, "float8": 1513 * _T}  # fmt: skip

DEVICES: Mapping[str, DeviceSpec] = FrozenMap(
    {
        "cpu": DeviceSpec(
            name="cpu",
            peak_flops={"float64": 50e9, "float32": 100e9, "bfloat16": 100e9, "float16": 100e9},
            mem_bandwidth_Bps=20e9,
            mem_capacity_bytes=24 * _GiB,
            matmul_efficiency=0.5,
            memory_efficiency=0.7,
            kernel_overhead_s=1e-5,
            source="generic 2-core x86 CPU (assumed: 100 GFLOP/s fp32 FMA, 20 GB/s, 24 GiB)",
            comm_backend="gloo",
            collectives_overlap_compute=False,
        ),
        "a100": DeviceSpec(
            name="a100",
            peak_flops=_A100_FLOPS,
            mem_bandwidth_Bps=2039e9,
            mem_capacity_bytes=80 * _GiB,
            source=f"{_A100_SRC}, A100 80GB SXM: FP64 TC 19.5 TF, FP32 19.5 TF, TF32 156 TF, "
            "BF16/FP16 312 TF (dense), 80 GB HBM2e, 2,039 GB/s",
        ),
        "a100-40gb": DeviceSpec(
            name="a100-40gb",
            peak_flops=_A100_FLOPS,
            mem_bandwidth_Bps=1555e9,
            mem_capacity_bytes=40 * _GiB,
            source=f"{_A100_SRC}, A100 40GB SXM: FP64 TC 19.5 TF, FP32 19.5 TF, TF32 156 TF, "
            "BF16/FP16 312 TF (dense), 40 GB HBM2, 1,555 GB/s",
        ),
        "h100": DeviceSpec(
            name="h100",
            peak_flops=_H100_SXM_FLOPS,
            mem_bandwidth_Bps=3.35e12,
            mem_capacity_bytes=80 * _GiB,
            source=f"{_H100_SRC}, H100 SXM: FP64 TC 67 TF, FP32 67 TF, TF32 494.5 TF, "
            "BF16/FP16 989.5 TF, FP8 1,979 TF (dense: half the with-sparsity figures), "
            "80 GB HBM3, 3.35 TB/s",
        ),
        "h100-pcie": DeviceSpec(
            name="h100-pcie",
            peak_flops=_H100_PCIE_FLOPS,
            mem_bandwidth_Bps=2.0e12,
            mem_capacity_bytes=80 * _GiB,
            source=f"{_H100_SRC}, H100 PCIe: FP64 TC 51 TF, FP32 51 TF, TF32 378 TF, "
            "BF16/FP16 756 TF, FP8 1,513 TF (dense), 80 GB HBM2e, 2.0 TB/s",
        ),
        "h200": DeviceSpec(
            name="h200",
            peak_flops=_H100_SXM_FLOPS,
            mem_bandwidth_Bps=4.8e12,
            mem_capacity_bytes=141 * _GiB,
            source=f"{_H200_SRC}, H200 SXM: FP64 TC 67 TF, FP32 67 TF, TF32 494.5 TF, "
            "BF16/FP16 989.5 TF, FP8 1,979 TF (dense), 141 GB HBM3e, 4.8 TB/s",
        ),
    }
)

LINKS: Mapping[str, LinkSpec] = FrozenMap(
    {
        "nvlink": LinkSpec(
            name="nvlink",
            bandwidth_Bps=450e9,
            latency_s=3e-6,
            source="NVIDIA H100 Tensor Core GPU datasheet: NVLink 4, 900 GB/s bidirectional "
            "per GPU = 450 GB/s per direction; latency ~3 us (assumed)",
        ),
        "nvlink3": LinkSpec(
            name="nvlink3",
            bandwidth_Bps=300e9,
            latency_s=3e-6,
            source="NVIDIA A100 Tensor Core GPU datasheet: NVLink 3, 600 GB/s bidirectional "
            "per GPU = 300 GB/s per direction; latency ~3 us (assumed)",
        ),
        "infiniband": LinkSpec(
            name="infiniband",
            bandwidth_Bps=50e9,
            latency_s=5e-6,
            source="NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gb/s = 50 GB/s per GPU "
            "(one NIC per GPU); latency ~5 us (assumed)",
        ),
        "ethernet": LinkSpec(
            name="ethernet",
            bandwidth_Bps=12.5e9,
            latency_s=10e-6,
            source="100 GbE: 100 Gb/s = 12.5 GB/s per direction; latency ~10 us (assumed)",
        ),
        "loopback": LinkSpec(
            name="loopback",
            bandwidth_Bps=2e9,
            latency_s=50e-6,
            source="gloo over TCP on one host: ~2 GB/s, ~50 us per step (assumed)",
        ),
    }
)

_ALIASES = {
    "a100-sxm": "a100", "a100-80gb": "a100", "a100-sxm-80gb": "a100", "a100-sxm-40gb": "a100-40gb",
    "h100-sxm": "h100", "h100-sxm-80gb": "h100", "h200-sxm": "h200",
    "nvlink4": "nvlink", "ib": "infiniband", "gloo": "loopback",
}  # fmt: skip


def backend_fields(backend: str) -> dict[str, Any]:
    """``DeviceSpec`` fields of a device whose collectives run on ``backend`` (as
    ``autopar calibrate`` finds it): gloo ranks share the CPU cores with the compute, so their
    collectives overlap nothing; NCCL's run on their own engine and link."""
    return {"comm_backend": backend, "collectives_overlap_compute": backend != "gloo"}


def get_device(name_or_spec: str | DeviceSpec) -> DeviceSpec:
    """A preset by name (case-insensitive; e.g. "h100", "a100-sxm-80gb"), or the spec itself."""
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise TypeError(f"expected a device name or DeviceSpec, got {type(name_or_spec).__name__}")
    return _lookup(name_or_spec, DEVICES, "device")


def get_link(name_or_spec: str | LinkSpec) -> LinkSpec:
    """A preset by name (case-insensitive; e.g. "nvlink", "infiniband"), or the spec itself."""
    if isinstance(name_or_spec, LinkSpec):
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise TypeError(f"expected a link name or LinkSpec, got {type(name_or_spec).__name__}")
    return _lookup(name_or_spec, LINKS, "link")
