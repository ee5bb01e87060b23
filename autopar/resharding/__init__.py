"""Resharding: placement A -> placement B as collective steps, priced and executed alike.

One function, :func:`autopar.resharding.steps.reshard_steps`, decides both the forward and the
backward steps of a conversion; the cost model prices them and the runtime
(``autopar.comm.collectives``) executes them, so a plan's predicted and executed communication
agree. The package is split by job, and callers import from the module that owns a name (this
``__init__`` re-exports nothing):

- :mod:`autopar.resharding.steps`: the contract. ``Step``, ``reshard_steps``,
  ``gradient_placements``, ``is_supported_pair`` and the placement validation they share.
- :mod:`autopar.resharding.routes`: the route search, a cheapest path over the placement graph
  of valid single-axis steps (Dijkstra, cached per mesh and divisibility pattern).
- :mod:`autopar.resharding.pricing`: ``price_table``, a whole [src, dst] table of route prices
  from one search per source (what the planner calls).
- :mod:`autopar.resharding.simulator`: ``simulate_steps``, ``shard_full``, ``assemble``: per-rank
  tensors in one process, the test oracle for the steps and for the runtime.
"""
