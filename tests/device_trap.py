"""Catch tensors that cw_lens creates without naming their device, on a machine with no GPU.

On a CPU-only machine every tensor lands on the CPU, so a tensor created on the wrong device
(`torch.zeros(n)` where the inputs are on `cuda:0`) cannot be seen by its value. It can be seen
by how it is created: a factory call (`torch.zeros`, `ones`, `empty`, `full`, `arange`,
`tensor`, `eye`, `rand`, `randn`, `randint`, `linspace`, ...) without `device=` puts the tensor
on the *default* device, which is the CPU here, but the GPU for a user who called
`torch.set_default_device("cuda")`, and never the inputs' device when those are on another GPU.

`FactoryTrap` is a `TorchFunctionMode` (the mechanism `torch.set_default_device` itself uses):
while it is active, every factory call is intercepted, and one whose innermost caller outside
`torch` is a file of the `cw_lens` package and that passes no `device` (or `device=None`) is
recorded as `file:line (function)`: `torch.as_tensor` and `torch.asarray` too, which under a
default device move even a tensor there. Calls from TransformerLens, transformers or the tests
are not cw_lens's and are not recorded. With `redirect=True` the trapped tensor is also
created on `meta` instead, so that using it with real data fails at once (the same effect as
`torch.set_default_device("meta")`, confined to cw_lens's own calls).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import cw_lens

PACKAGE = Path(cw_lens.__file__).parent
TORCH = Path(torch.__file__).parent
FACTORIES = _device_constructors()


def cw_lens_caller() -> str | None:
    """`file:line (function)` of the innermost frame outside torch and this module, when it
    is a file of the cw_lens package; else `None`."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if TORCH not in path.parents and path != Path(__file__):
            if PACKAGE in path.parents:
                where = path.relative_to(PACKAGE).as_posix()
                return f"{where}:{frame.f_lineno} ({frame.f_code.co_name})"
            return None
        frame = frame.f_back
    return None


class FactoryTrap(TorchFunctionMode):
    """Record cw_lens's factory calls that name no device (see the module docstring)."""

    def __init__(self, redirect: bool = False) -> None:
        super().__init__()
        self.redirect = redirect
        self.sites: dict[str, str] = {}  # site -> the factory's name

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None:
            site = cw_lens_caller()
            if site is not None:
                self.sites.setdefault(site, func.__name__)
                if self.redirect:
                    kwargs["device"] = "meta"
        return func(*args, **kwargs)

    def report(self) -> str:
        return "\n".join(f"  {site}: torch.{name}" for site, name in sorted(self.sites.items()))
