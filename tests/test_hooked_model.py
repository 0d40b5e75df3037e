"""The embedded SmolLM2-135M as a HookedTransformer: its logits equal the Hugging Face model's,
its hooks equal the bridge's, and every TransformerLens environment reads the same model."""

from __future__ import annotations

import pytest
import torch
from apis import needs_both

from cw_lens import models
from cw_lens.gguf_cache import load_gguf_hf
from cw_lens.weight_processing import processing_warnings

pytestmark = [pytest.mark.model, pytest.mark.compat]

PROMPT = "The capital of France is Paris. The capital of Germany is"
TOKENS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]
# top-5 next-token logits, measured with the bridge (TL 4.3, transformers 5.24): a cache read
# with the wrong rotary base or an untied head gives other numbers
TOP5_IDS = [11452, 4521, 422, 34391, 4528]
TOP5_LOGITS = [16.9916, 12.8786, 11.5187, 11.3707, 10.4688]


def test_every_environment_reads_the_same_model(smollm):
    """Same tokens and next-token logits in TL 2.18/3.9/4.3 (whatever load_model() gives)."""
    tokens = smollm.to_tokens(PROMPT)
    assert tokens[0].tolist() == TOKENS
    with torch.inference_mode():
        top = smollm(tokens)[0, -1].topk(5)
    assert top.indices.tolist() == TOP5_IDS
    assert torch.allclose(top.values, torch.tensor(TOP5_LOGITS), atol=2e-3)


def test_hooked_smollm_is_the_raw_model(smollm_hooked):
    cfg = smollm_hooked.cfg
    assert type(smollm_hooked).__name__ == "HookedTransformer"
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model) == (
        30,
        9,
        3,
        64,
        576,
    )
    assert cfg.rotary_base == 1e5 and cfg.normalization_type == "RMS" and cfg.gated_mlp
    assert processing_warnings(smollm_hooked) == []
    hf, _ = load_gguf_hf(models.embedded_gguf_path(), "cpu", torch.float32)
    assert cfg.eps == hf.config.rms_norm_eps
    texts = [PROMPT, "Contribution weights measure what attention moves, token by token."]
    tokens = smollm_hooked.to_tokens(texts)  # right-padded batch
    mask = (tokens != smollm_hooked.tokenizer.pad_token_id).long()
    mask[:, 0] = 1
    with torch.inference_mode():
        ours = smollm_hooked(tokens, attention_mask=mask)
        theirs = hf(tokens, attention_mask=mask).logits
    real = mask.bool()
    diff = (ours - theirs)[real].abs().max().item()
    assert diff <= 2e-4, f"max |logit difference| {diff:.2e}"  # measured 3e-5 .. 7e-5
    assert smollm_hooked.to_string(ours[0, len(TOKENS) - 1].argmax()) == " Berlin"


@needs_both
def test_hooked_and_bridge_smollm_hooks_agree(smollm, smollm_hooked):
    from cw_lens.capture import cache_names

    tokens = smollm.to_tokens(PROMPT)
    assert torch.equal(smollm_hooked.to_tokens(PROMPT), tokens)
    names = cache_names(list(range(smollm.cfg.n_layers)))
    with torch.inference_mode():
        _, ours = smollm_hooked.run_with_cache(tokens, names_filter=names)
        _, theirs = smollm.run_with_cache(tokens, names_filter=names)
    for name in names:
        scale = theirs[name].abs().max()
        assert (ours[name] - theirs[name]).abs().max() <= 1e-5 * scale, name
