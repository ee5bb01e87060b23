"""One stack-of-blocks pattern for tying, checkpoint segments and pipeline cuts."""

from __future__ import annotations

import pytest

from autopar.capture.blocks import block_of_path, index_in_stack


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("layers.3.attn.wq", ("layers", 3)),
        ("transformer.h.11.mlp", ("transformer.h", 11)),
        ("encoder.layer.0", ("encoder.layer", 0)),
        ("model.blocks.2.weight", ("model.blocks", 2)),
        ("tok_embeddings.weight", None),
        ("hh.3.x", None),  # a stack name must be a whole name
        ("layers.x.y", None),
        ("", None),
    ],
)
def test_block_of_path(path, expected):
    assert block_of_path(path) == expected


@pytest.mark.parametrize(
    ("path", "stack", "expected"),
    [
        ("layers.3.attn.wq.weight", "layers", 3),
        ("layers.12", "layers", 12),
        ("transformer.h.7.ln_1.bias", "transformer.h", 7),
        ("transformer.h.7.ln_1.bias", "h", None),  # the stack's full path, from the start
        ("layers3.0.w", "layers", None),
        ("layers.w", "layers", None),
        ("norm.weight", "layers", None),
    ],
)
def test_index_in_stack(path, stack, expected):
    assert index_in_stack(path, stack) == expected
