"""Lowering: a captured graph and the chosen strategies -> a graph on local shards."""

from autopar.lowering.local_ops import (
    autopar_dropout,
    autopar_scale_grad,
    autopar_vocab_parallel_embedding,
)
from autopar.lowering.rewrite import LoweredGraph, PlaceholderSource, drop_capture_meta, lower

__all__ = [
    "LoweredGraph",
    "PlaceholderSource",
    "autopar_dropout",
    "autopar_scale_grad",
    "autopar_vocab_parallel_embedding",
    "drop_capture_meta",
    "lower",
]
