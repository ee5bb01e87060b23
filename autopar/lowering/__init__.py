"""Lowering: a captured graph and the chosen strategies -> a graph on local shards."""

from autopar.lowering.rewrite import LoweredGraph, PlaceholderSource, autopar_dropout, lower

__all__ = ["LoweredGraph", "PlaceholderSource", "autopar_dropout", "lower"]
