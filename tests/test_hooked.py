"""HookedTransformer support: raw-weight tiny HookedTransformers compute what their Hugging Face
models compute and expose what the bridge exposes; clear errors where a class does not exist."""

from __future__ import annotations

import pytest
import torch
from apis import HAS_BRIDGE, HAS_HOOKED, TL_VERSION, needs_both, needs_hooked

import cw_lens
from cw_lens.core.errors import InputError, ModelLoadError, UnsupportedModelError
from cw_lens.models import hooked, testing
from cw_lens.models.testing import random_tokens

BUILDERS = {
    "llama": (testing.tiny_llama_hf, testing.tiny_llama),
    "gpt2": (testing.tiny_gpt2_hf, testing.tiny_gpt2),
}


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@needs_hooked
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_hooked_tiny_model_computes_its_hf_model(arch):
    """Logits of the converted model equal the transformers model's, also on a padded batch."""
    build_hf, build = BUILDERS[arch]
    hf = build_hf(seed=1)
    model = build(seed=1, api="hooked")
    assert type(model).__name__ == "HookedTransformer"
    tokens = random_tokens(model, 2, 17, seed=2)
    mask = torch.ones_like(tokens)
    mask[1, 11:] = 0  # right padding in row 1
    with torch.inference_mode():
        ours = model(tokens)
        theirs = hf(tokens).logits
        ours_pad = model(tokens, attention_mask=mask)
        theirs_pad = hf(tokens, attention_mask=mask).logits
    assert _max_rel(ours, theirs) <= 1e-5
    real = mask.bool()
    assert _max_rel(ours_pad[real], theirs_pad[real]) <= 1e-5


@needs_hooked
def test_grouped_query_attention_keeps_its_kv_heads():
    model = testing.tiny_llama(seed=0, api="hooked")
    assert (model.cfg.n_heads, model.cfg.n_key_value_heads) == (4, 2)
    _, cache = model.run_with_cache(
        random_tokens(model, 1, 6), names_filter=lambda n: "hook_v" in n
    )
    assert cache["blocks.0.attn.hook_v"].shape == (1, 6, 2, 16)


@needs_hooked
def test_rotary_base_comes_from_the_config():
    """A Llama with rope_theta 1e5 (like SmolLM2): TL's generic default 1e4 would be wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=testing.VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_theta=1e5,
        initializer_range=0.3,
        attn_implementation="eager",
    )
    hf = LlamaForCausalLM(config).eval()
    model = hooked.from_hf(hf, testing.byte_tokenizer(), name="rope-1e5")
    assert model.cfg.rotary_base == 1e5
    tokens = random_tokens(model, 1, 40, seed=1)
    with torch.inference_mode():
        theirs = hf(tokens).logits
        assert _max_rel(model(tokens), theirs) <= 1e-5
        # the check bites: the same weights with TL's default base give other logits
        config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
        config.rope_theta = 1e4
        wrong = hooked.from_hf(hf, testing.byte_tokenizer(), name="rope-1e4")
        assert wrong.cfg.rotary_base == 1e4
        assert _max_rel(wrong(tokens), theirs) > 1e-3


@needs_hooked
def test_a_parameter_the_converter_misses_is_refused(monkeypatch):
    """No parameter may stay uninitialised (init_weights=False leaves torch.empty memory)."""
    convert = hooked._state_dict

    def drop_one(hf_model, cfg):
        state = convert(hf_model, cfg)
        del state["blocks.1.attn.W_O"]
        return state

    monkeypatch.setattr(hooked, "_state_dict", drop_one)
    with pytest.raises(UnsupportedModelError, match=r"blocks\.1\.attn\.W_O"):
        testing.tiny_gpt2(seed=0, api="hooked")


@needs_hooked
def test_other_architectures_are_refused_with_the_alternative():
    from transformers import MistralConfig

    with pytest.raises(UnsupportedModelError, match="from_pretrained_no_processing"):
        hooked.hooked_config(MistralConfig(), name="mistral")


@needs_both
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_hooked_and_bridge_expose_the_same_activations(arch):
    """The four hooks cw_lens reads and W_O/b_O agree between the two classes (same weights)."""
    _, build = BUILDERS[arch]
    bridge, model = build(seed=3, api="bridge"), build(seed=3, api="hooked")
    tokens = random_tokens(model, 2, 12, seed=4)
    names = cw_lens.cache_names(list(range(model.cfg.n_layers)))
    with torch.inference_mode():
        _, ours = model.run_with_cache(tokens, names_filter=names)
        _, theirs = bridge.run_with_cache(tokens, names_filter=names)
    for name in names:
        assert ours[name].shape == theirs[name].shape, name
        assert _max_rel(ours[name], theirs[name]) <= 1e-5, name
    for layer in range(model.cfg.n_layers):
        a, b = model.blocks[layer].attn, bridge.blocks[layer].attn
        assert torch.allclose(a.W_O, b.W_O, atol=1e-7)
        if arch == "gpt2":
            assert torch.allclose(a.b_O, b.b_O, atol=1e-7)


def test_load_model_api_choices():
    with pytest.raises(InputError, match="api must be one of"):
        cw_lens.load_model("testing:tiny-llama", api="hooked-transformer")
    auto = cw_lens.load_model("testing:tiny-llama")
    assert hooked.is_bridge(auto) == HAS_BRIDGE
    assert hooked.is_hooked(auto) == (not HAS_BRIDGE)
    assert cw_lens.load_model(auto) is auto
    other = "hooked" if HAS_BRIDGE else "bridge"
    with pytest.raises(InputError, match="does not convert a loaded model"):
        cw_lens.load_model(auto, api=other)


@pytest.mark.skipif(HAS_HOOKED, reason=f"TransformerLens {TL_VERSION} has HookedTransformer")
def test_hooked_in_transformer_lens_4_names_the_fix():
    with pytest.raises(UnsupportedModelError, match=r"4\.0 removed it.*api='bridge'.*<4"):
        cw_lens.load_model(api="hooked")  # refused before any de-quantising
    with pytest.raises(UnsupportedModelError, match="HookedTransformer does not exist"):
        testing.tiny_gpt2(api="hooked")


@pytest.mark.skipif(HAS_BRIDGE, reason=f"TransformerLens {TL_VERSION} has TransformerBridge")
def test_bridge_in_transformer_lens_2_names_the_fix():
    with pytest.raises(UnsupportedModelError, match=r"needs TransformerLens 3\.0.*api='hooked'"):
        cw_lens.load_model("testing:tiny-gpt2", api="bridge")


@needs_hooked
def test_hooked_hub_name_goes_through_from_pretrained_no_processing():
    with pytest.raises(ModelLoadError, match="from_pretrained_no_processing could not load"):
        cw_lens.load_model("no-such-org/no-such-model-xyz", api="hooked")
