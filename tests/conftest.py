"""Shared fixtures: tiny random models (fast) and the embedded SmolLM2 (session-scoped)."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from apis import APIS
from hypothesis import settings

# hypothesis draws the same examples on every run (CI must not pass or fail by chance);
# HYPOTHESIS_PROFILE=explore searches afresh
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# two threads per test process, or the cores shared out among pytest-xdist's workers
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_THREADS)
if _WORKERS > 1:  # the processes tests start (notebook kernels, the CLI) get the same share:
    # more OpenMP threads than cores makes every thread wait at each barrier
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


@functools.cache
def _tiny_model(arch: str, api: str):
    from cw_lens.models import testing
    from cw_lens.models.hooked import resolve_api

    build = {"llama": testing.tiny_llama, "gpt2": testing.tiny_gpt2}[arch]
    return build(seed=0, api=resolve_api(api))


@pytest.fixture(scope="session")
def llama():
    """The tiny Llama (GQA, RMSNorm, rotary): a bridge, or a HookedTransformer in TL 2.x."""
    return _tiny_model("llama", "auto")


@pytest.fixture(scope="session")
def gpt2():
    """The tiny GPT-2 (biases, LayerNorm): a bridge, or a HookedTransformer in TL 2.x."""
    return _tiny_model("gpt2", "auto")


TINY_PARAMS = [(arch, api) for arch in ("llama", "gpt2") for api in APIS]


@pytest.fixture(scope="session", params=TINY_PARAMS, ids="-".join)
def tiny(request):
    """Each tiny architecture as each model class this TransformerLens has (the core
    correctness tests run on both a TransformerBridge and a HookedTransformer in TL 3.x)."""
    return _tiny_model(*request.param)


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct: a bridge, or a HookedTransformer in TL 2.x (fails,
    never skips, when the wheel is missing)."""
    import cw_lens

    return cw_lens.load_model(device="cpu")


@pytest.fixture(scope="session")
def smollm_hooked(request):
    """The embedded SmolLM2 as a raw-weight HookedTransformer (skips where TL has none)."""
    from apis import HAS_BRIDGE, needs_hooked

    import cw_lens

    if needs_hooked.args[0]:
        pytest.skip(needs_hooked.kwargs["reason"])
    if not HAS_BRIDGE:  # TL 2.x: the default fixture already is a HookedTransformer
        return request.getfixturevalue("smollm")
    return cw_lens.load_model(api="hooked", device="cpu")


@pytest.fixture(scope="session")
def prose(smollm):
    import cw_lens

    return cw_lens.load_corpus(n_docs=2, max_tokens=48, model=smollm, seed=1)


@pytest.fixture(scope="module")
def browser():
    """Headless Debian chromium via Playwright, one per test module (see tests/browser.py)."""
    from browser import launch
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (tiny models run several times faster on one:
    no synchronisation per op); the count is restored after the module."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A run folder of `cw-lens compare` with one number and its replicates over 8 documents."""
    import numpy as np
    from test_compare import _run_with

    rng = np.random.default_rng(0)
    docs = [f"{i:016d}" for i in range(8)]
    numbers = {"x": (1.0, rng.normal(1, 0.1, 2000).astype(np.float32))}
    return _run_with(tmp_path_factory.mktemp("runs") / "a", numbers, docs)
