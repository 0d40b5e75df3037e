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

    return cw_lens.load_corpus(n_docs=2, max_tokens=48, tokenizer=smollm, seed=1)
