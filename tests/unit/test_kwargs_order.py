"""The runtime's keyword inputs follow the captured order without torch's deprecation warnings
(``TreeSpec.children_specs`` warns in the torch this project installs; every forward with
keyword inputs printed it)."""

from __future__ import annotations

import warnings

import pytest
from torch.utils._pytree import tree_flatten

from autopar.runtime.module import _reorder_kwargs


def test_keyword_inputs_take_the_captured_order_silently() -> None:
    _, in_spec = tree_flatten(((1, 2), {"labels": 0, "input_ids": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ordered = _reorder_kwargs({"input_ids": "a", "labels": "b"}, in_spec)
    assert list(ordered) == ["labels", "input_ids"]
    assert ordered == {"labels": "b", "input_ids": "a"}


def test_keyword_inputs_unlike_the_captured_ones_are_refused() -> None:
    _, in_spec = tree_flatten(((1,), {"labels": 0}))
    with pytest.raises(ValueError, match="differ from the captured ones"):
        _reorder_kwargs({"targets": 1}, in_spec)
