"""The keys of recorded priced solves (solver/budgeted.py): an edge's hash is taken once while
the edge is in the problems keyed one after another, and is the edge's own hash."""

from __future__ import annotations

from solver import Edge, Node, Problem
from solver.budgeted import EdgeHashes, _answer_key

HASHED: list[int] = []


class _CountedTable(tuple):
    """An edge table that counts how often it is hashed (as the plain tuple would hash)."""

    def __hash__(self) -> int:
        HASHED.append(1)
        return tuple.__hash__(self)


def _edge(src: int, dst: int, value: float) -> Edge:
    return Edge(src=src, dst=dst, cost_s=_CountedTable(((value, None), (1.0, 2.0))))


def test_an_edge_met_again_in_the_next_problem_is_not_hashed_again() -> None:
    first, second, third = _edge(0, 1, 0.5), _edge(1, 2, 0.25), _edge(0, 2, 4.0)
    hashes = EdgeHashes()
    HASHED.clear()
    assert hashes((first, second)) == (hash(first), hash(second))
    HASHED.clear()
    assert hashes((first, third))[0] == hash(first)
    assert len(HASHED) == 2  # third's hash and the hash() above: first's was kept
    HASHED.clear()
    hashes((second, third))  # second was not in the last problem: hashed again
    assert len(HASHED) == 1


def test_equal_edges_of_other_objects_give_equal_keys() -> None:
    nodes = tuple(Node(name=f"n{i}", cost_s=(1.0, 2.0), memory_bytes=(0.0, 0.0)) for i in range(3))
    edges = (_edge(0, 1, 0.5), _edge(1, 2, 0.25))
    problem = Problem(nodes=nodes, edges=edges)
    copy = Problem(nodes=nodes, edges=(_edge(0, 1, 0.5), _edge(1, 2, 0.25)))
    other = Problem(nodes=nodes, edges=(_edge(0, 1, 0.5), _edge(1, 2, 0.75)))
    recorded_edges = (_edge(0, 1, 9.0),)
    hashes = EdgeHashes()
    key = _answer_key(problem, recorded_edges, hashes)
    assert _answer_key(copy, recorded_edges, hashes) == key == _answer_key(copy, recorded_edges)
    assert _answer_key(other, recorded_edges, hashes) != key
    # The recorded problem's very edges are keyed without hashing them.
    HASHED.clear()
    assert _answer_key(problem, edges, hashes)[-1] is True
    assert not HASHED
