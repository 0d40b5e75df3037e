"""Call forms of the interactive results kept with a warning after their meaning changed.

`warn_positional_top` wraps `SinkPatchComparisonResult.top`, whose first positional argument was the
position until 0.3.3 and is now `k`, as in every result's `top`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pandas as pd


def warn_positional_top(top: Callable[..., pd.DataFrame]) -> Callable[..., pd.DataFrame]:
    """`SinkPatchComparisonResult.top(n)` read `n` as the position until 0.3.3; now `n` is
    `k`, as in every result's `top`: a positional argument warns (FutureWarning).

    Args:
        top: The method `SinkPatchComparisonResult.top`.

    Returns:
        The method, warning when it is given a positional argument.
    """

    @functools.wraps(top)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> pd.DataFrame:
        if args:
            warnings.warn(
                "SinkPatchComparisonResult.top(n) reads n as k, the number of next tokens, as "
                "every result's top() does (until 0.3.3 it was the position): pass k=... or "
                "position=... by keyword.",
                FutureWarning,
                stacklevel=2,
            )
        return top(self, *args, **kwargs)

    return wrapper
