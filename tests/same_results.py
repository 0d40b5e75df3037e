"""Bit-for-bit comparison of two analysis results (NaN-aware), field by field.

`assert_same(a, b)` walks dataclasses, dicts, lists and tuples, and compares tensors with
`torch.equal` after checking dtype, shape and the NaN positions, DataFrames with
`pandas.testing.assert_frame_equal(check_exact=True)`, numpy arrays with
`numpy.testing.assert_array_equal`, floats with `==` (NaN equal to NaN), other objects by their
public attributes (private ones may hold unused buffer space). The path of the first difference
is in the message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pandas as pd
import torch

# fields that legitimately differ between two runs of the same analysis
SKIPPED = {"model_name", "elapsed", "seconds", "timings"}


def assert_same(a: Any, b: Any, path: str = "result") -> None:
    """Raise AssertionError at the first value of `a` that is not bit for bit `b`'s."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)}"
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()), f"{path}: NaN positions differ"
            a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
        assert torch.equal(a, b), f"{path}: max |diff| {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, pd.DataFrame | pd.Series):
        compare = (
            pd.testing.assert_frame_equal
            if isinstance(a, pd.DataFrame)
            else pd.testing.assert_series_equal
        )
        try:
            compare(a, b, check_exact=True)
        except AssertionError as err:
            raise AssertionError(f"{path}: {err}") from None
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif dataclasses.is_dataclass(a):
        for field in dataclasses.fields(a):
            if field.name not in SKIPPED:
                assert_same(getattr(a, field.name), getattr(b, field.name), f"{path}.{field.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for key in a:
            if key not in SKIPPED:
                assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, torch.nn.Module | type) and not callable(a):
        public = {k: v for k, v in vars(a).items() if not k.startswith("_")}
        assert_same(public, {k: v for k, v in vars(b).items() if k in public}, path)
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"
