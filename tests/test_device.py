"""Device-clean for GPU users: every tensor an analysis creates follows its inputs' device, and
the analysis arithmetic runs in float32 whatever the model's dtype.

How a tensor created on the wrong device is caught without a GPU (`tests/device_trap.py`):

1. `FactoryTrap`, a `TorchFunctionMode`, intercepts every factory call (`torch.zeros`, `ones`,
   `empty`, `full`, `arange`, `tensor`, `as_tensor`, `eye`, `rand`, `randn`, `randint`,
   `linspace`, ... : the functions `torch.set_default_device` redirects) made while the
   analyses run, and records each one whose innermost caller outside torch is a cw_lens file
   and that names no device, as `file:line (function)`. Such a tensor goes to the default
   device, not to its inputs' device; the test fails listing every site.
2. The same analyses run again under `torch.set_default_device("meta")`, with the model and
   its inputs on the CPU: a tensor created without a device anywhere in the pass (cw_lens,
   TransformerLens or transformers) lands on `meta`, has no data, and either raises the moment
   it meets real data or leaks `meta` into a result; every result must equal the plain run's
   bit for bit.
3. On a machine with CUDA (`benchmarks/gpu_check.sh` runs `pytest -m device` there) the
   analyses run on the GPU and are compared with the CPU run; elsewhere that test is skipped,
   visibly.

The dtype tests load the tiny Llama in bfloat16, float16 and float64: contribution weights and
every other floating result come out float32 (statistics accumulate in float64 by design, and
only those may be float64), never in the model's dtype. A float64 model's analyses also run in
float32 (docs/methods.md#contribution-weights: the analysis math is float32 whatever the
model's dtype).
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from battery import TEXTS, analyses
from device_trap import FactoryTrap
from same_results import assert_same

import cw_lens
from cw_lens.models.testing import tiny_gpt2, tiny_llama

pytestmark = pytest.mark.device
CUDA = torch.cuda.is_available()
# on CUDA every analysis runs; those without discrete choices (a sink head, a ranking, a
# regime that float rounding could flip) are compared with the CPU's numbers
COMPARED_ON_CUDA = ("intra", "inter", "shares", "rollout")


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_every_tensor_an_analysis_creates_names_its_device(build):
    model = build(seed=0)  # a fresh model (on the CPU): verification runs under the trap too
    trap = FactoryTrap()
    try:
        torch.set_default_device("meta")
        with trap:
            got = analyses(model)
    finally:
        torch.set_default_device(None)
    assert not trap.sites, (
        "cw_lens created tensors without naming a device (they go to the default device, not "
        f"to their inputs' device):\n{trap.report()}"
    )
    on_meta = [path for name, r in got.items() for path, device in _devices(r, name)
               if device.type == "meta"]  # fmt: skip
    assert not on_meta, on_meta
    if build is tiny_llama:  # and nothing changed
        expected = analyses(build(seed=0))
        for name in expected:
            assert_same(got[name], expected[name], name)


def test_the_trap_catches_a_factory_call_without_a_device():
    trap = FactoryTrap()
    code = compile(
        "import torch\nx = torch.zeros(3)\ny = torch.ones(2, device='cpu')\n",
        str(cw_lens.models.testing.__file__),  # as if it were a line of cw_lens
        "exec",
    )
    with trap:
        exec(code, {})
        torch.arange(4)  # the test's own call: not cw_lens's
    assert list(trap.sites) == ["models/testing.py:2 (<module>)"]


def test_the_meta_default_device_catches_a_tensor_created_without_a_device():
    values = torch.ones(2, 3)
    try:
        torch.set_default_device("meta")
        with pytest.raises((RuntimeError, NotImplementedError)):
            (values * torch.ones(3)).sum().item()
    finally:
        torch.set_default_device(None)


def _tensors(result, path="result"):
    """(path, tensor) of every tensor in a result (dataclass fields, dicts, lists)."""
    if isinstance(result, torch.Tensor):
        return [(path, result)]
    out = []
    if dataclasses.is_dataclass(result):
        for f in dataclasses.fields(result):
            out += _tensors(getattr(result, f.name), f"{path}.{f.name}")
    elif isinstance(result, dict):
        for k, v in result.items():
            out += _tensors(v, f"{path}[{k!r}]")
    elif isinstance(result, list | tuple):
        for i, v in enumerate(result):
            out += _tensors(v, f"{path}[{i}]")
    return out


def _devices(result, path="result"):
    return [(p, t.device) for p, t in _tensors(result, path)]


def _floating(result, path="result"):
    """(path, dtype) of every floating tensor in a result."""
    return [(p, t.dtype) for p, t in _tensors(result, path) if t.is_floating_point()]


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float64], ids=["bf16", "fp16", "fp64"]
)
def test_the_arithmetic_is_float32_whatever_the_model_dtype(dtype):
    model = tiny_llama(seed=0, dtype=dtype)
    reference = tiny_llama(seed=0)
    for kind in ("intra", "inter"):
        cw = cw_lens.contribution_weights(model, TEXTS, kind=kind)
        fields = [*cw.FIELDS, "projected_value_norm", "output_norm", "head_output_norm"]
        assert {name: getattr(cw, name).dtype for name in fields} == dict.fromkeys(
            fields, torch.float32
        )
        close = cw_lens.contribution_weights(reference, TEXTS, kind=kind)
        tol = 1e-5 if dtype == torch.float64 else 0.1  # the model's own rounding
        torch.testing.assert_close(
            cw.attention, close.attention, atol=tol, rtol=tol, equal_nan=True
        )
    results = analyses(model, ("sinks", "selection", "shares"))
    wrong = [
        (path, dt)
        for name, result in results.items()
        for path, dt in _floating(result, name)
        if dt not in (torch.float32, torch.float64)
    ]
    assert not wrong, wrong


@pytest.mark.skipif(not CUDA, reason="no CUDA device: the CPU-only checks above stand in")
def test_on_cuda_every_result_follows_the_inputs_and_matches_the_cpu():
    cpu = analyses(tiny_llama(seed=0), COMPARED_ON_CUDA)
    model = tiny_llama(seed=0).to("cuda", print_details=False)
    trap = FactoryTrap()
    with trap:
        gpu = analyses(model)  # every analysis: a tensor on the wrong device raises
    assert not trap.sites, trap.report()
    for kind in ("intra", "inter"):
        assert gpu[kind].weights.device.type == "cuda"
    for name in COMPARED_ON_CUDA:
        _close(gpu[name], cpu[name], name)


def _close(a, b, path):
    """`assert_same` up to float rounding (GPU kernels round differently)."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(
            a.cpu(), b.cpu(), atol=1e-4, rtol=1e-3, equal_nan=True, msg=lambda m: f"{path}: {m}"
        )
    elif isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-3, atol=1e-4)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            if f.name != "model_name":
                _close(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        for k in a:
            _close(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-4, nan_ok=True), path
