"""Frozen tables the device and link specs hold, and the checks of their entries (split out of
:mod:`cost_models.hardware`, which re-exports ``FrozenMap``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any


class FrozenMap(Mapping[str, Any]):
    """An immutable, hashable, picklable str-keyed mapping (dataclass fields stay frozen)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data: dict[str, Any] = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items())))

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (self._data,))


def count_table(device: str, name: str, table: Mapping[Any, float], what: str) -> FrozenMap:
    """``table`` keyed by counts (of ranks, of cores) >= 1, frozen with string keys; its values
    must be > 0 (speeds) or, for ``core_wait_s``, >= 0."""
    for count, value in table.items():
        if not (str(count).isdigit() and int(count) >= 1 and value >= 0
                and (value > 0 or name == "core_wait_s")):  # fmt: skip
            least = "waits >= 0" if name == "core_wait_s" else "speeds > 0"
            raise ValueError(f"device {device!r}: {name} needs {what} counts >= 1 as keys and "
                             f"{least}, got {count!r}: {value!r}")  # fmt: skip
    return FrozenMap({str(int(k)): float(v) for k, v in table.items()})


def check_fraction(owner: str, what: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{owner}: {what} must be in (0, 1], got {value}")


def quantile_table(device: str, name: str, values: Sequence[float]) -> tuple[float, ...]:
    """``values`` (quantiles of a duration, ascending) frozen as floats; each must be >= 0 and
    none below the one before."""
    table = tuple(float(v) for v in values)
    if any(v < 0 for v in table) or any(b < a for a, b in zip(table, table[1:])):
        raise ValueError(f"device {device!r}: {name} needs ascending seconds >= 0 (quantiles), "
                         f"got {list(values)!r}")  # fmt: skip
    return table


def quantiles_by_count(device: str, name: str, table: Mapping[Any, Sequence[float]]) -> FrozenMap:
    """``table`` of :func:`quantile_table` values keyed by counts >= 0 (of other ranks), frozen
    with string keys."""
    for count in table:
        if not str(count).isdigit():
            raise ValueError(f"device {device!r}: {name} needs counts >= 0 as keys, got "
                             f"{count!r}")  # fmt: skip
    return FrozenMap({str(int(k)): quantile_table(device, f"{name}[{str(k)!r}]", v)
                      for k, v in table.items()})  # fmt: skip


def pair_table(
    link: str, name: str, table: Mapping[str, Sequence[float]], kinds: Sequence[str]
) -> FrozenMap:
    """``table`` of ``(alpha, beta)`` pairs keyed by collective kind (one of ``kinds``), frozen
    as float pairs; both must be >= 0."""
    frozen: dict[str, tuple[float, float]] = {}
    for kind, pair in table.items():
        if kind not in kinds:
            raise ValueError(f"link {link!r}: unknown collective {kind!r}; known: {tuple(kinds)}")
        alpha, beta = (float(x) for x in pair)
        if alpha < 0 or beta < 0:
            raise ValueError(f"link {link!r}: {name}[{kind!r}] must be >= 0")
        frozen[kind] = (alpha, beta)
    return FrozenMap(frozen)


def measured_points(
    link: str, smallest: Mapping[str, Sequence[float]],
    small_messages: Mapping[str, Sequence[Sequence[float]]], fitted: Sequence[str],
) -> tuple[FrozenMap, FrozenMap]:  # fmt: skip
    """A link's ``smallest`` (one ``(bytes, seconds)`` per kind) and ``small_messages``
    (``(bytes, seconds)`` points per kind, bytes ascending, all below that kind's ``smallest``
    bytes where it has one), frozen as floats; every kind must have a calibrated fit
    (``fitted``), bytes must be > 0 and seconds >= 0."""

    def point(kind: str, name: str, pair: Sequence[float]) -> tuple[float, float]:
        if kind not in fitted:
            raise ValueError(f"link {link!r}: {name}[{kind!r}] without a calibrated fit")
        nbytes, seconds = (float(x) for x in pair)
        if nbytes <= 0 or seconds < 0:
            raise ValueError(f"link {link!r}: {name}[{kind!r}] must be (bytes > 0, s >= 0)")
        return nbytes, seconds

    small = {kind: point(kind, "smallest", pair) for kind, pair in smallest.items()}
    tables: dict[str, tuple[tuple[float, float], ...]] = {}
    for kind, points in small_messages.items():
        table = tuple(point(kind, "small_messages", p) for p in points)
        top = small.get(kind, (float("inf"), 0.0))[0]
        if not table or any(b[0] <= a[0] for a, b in zip(table, table[1:])) or table[-1][0] >= top:
            raise ValueError(f"link {link!r}: small_messages[{kind!r}] needs points of ascending "
                             f"bytes below smallest[{kind!r}]'s, got {list(points)!r}")  # fmt: skip
        tables[kind] = table
    return FrozenMap(small), FrozenMap(tables)
