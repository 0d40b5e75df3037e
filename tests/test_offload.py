"""Offloaded and dispatched models give the resident model's results bit for bit.

A model loaded with `device_map` and disk offload (`accelerate` big-model inference) keeps the
weights of offloaded modules on `meta` between forward passes. cw_lens reads weights outside a
forward pass only through `cw_lens.models.offload.resident_weights` (enforced by
`tests/test_layout.py`), so every analysis must give exactly the resident model's numbers.
Tiny random Llama (GQA), Qwen2 (qkv biases), Gemma 2 (post-norm, soft-capping) and GPT-2
(biases, LayerNorm) are saved with `save_pretrained`, loaded twice with `cw_lens.load_model`
(resident, and with layer 1 and the output head on disk) and compared analysis by analysis.
The hooks of the GGUF layer-streaming loader (one `AlignDevicesHook` per module with a lazy
weights map) are checked the same way on a model whose weights map counts its reads.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections import Counter
from collections.abc import Iterator, Mapping

import pytest
import torch
from architectures import ARCHS, hf_model
from battery import TEXTS, analyses
from same_results import assert_same

import cw_lens
import cw_lens.models.weight_processing
from cw_lens.core.errors import UnsupportedModelError
from cw_lens.data.inputs import prepare_inputs
from cw_lens.models.capture import run_layers
from cw_lens.models.offload import is_offloaded, read_weights, resident_weights
from cw_lens.models.testing import _wrap, byte_tokenizer, tiny_llama_hf

pytest.importorskip("accelerate")
pytest.importorskip("transformer_lens.model_bridge", reason="device_map needs a TransformerBridge")

_TL_MAJOR = int(importlib.metadata.version("transformer-lens").split(".")[0])
ARCH_NAMES = ["Llama", "Qwen2", "Gemma 2", "GPT-2"]
# every analysis on Llama; the others run those that read weights (verification, contribution
# weights, the pruning order, the flow analyses with Gemma 2's post-attention norm): their
# weights differ, not the places where they are read
EVERY_ANALYSIS = ("Llama",)
WEIGHT_READERS = ("verify", "intra", "inter", "magnitudes", "shares")
_LAYER = re.compile(r"^(.*\.(?:layers|h)\.\d+)\.")


def device_map(model: torch.nn.Module) -> dict[str, str]:
    """Layer 0 and the embeddings on the CPU; the other layers and the output head on disk."""
    out: dict[str, str] = {}
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    for name in names:
        layer = _LAYER.match(name)
        module = layer.group(1) if layer else name.rsplit(".", 1)[0]
        on_disk = (layer and not module.endswith(".0")) or module == "lm_head"
        out[module] = "disk" if on_disk else "cpu"
    return out


def on_meta(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.device.type == "meta"]


@pytest.fixture(scope="module", params=ARCH_NAMES)
def pair(request, tmp_path_factory):
    """The architecture's random float32 model saved with its tokenizer, then loaded with
    `cw_lens.load_model` twice: resident, and with layer 1 and the output head on disk."""
    arch = next(a for a in ARCHS if a.name == request.param)
    folder = tmp_path_factory.mktemp(re.sub(r"\W", "", arch.name))
    hf = hf_model(arch, seed=0, dtype=torch.float32)
    hf.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    resident = cw_lens.load_model(str(folder))
    options = {"device_map": device_map(hf), "offload_folder": str(folder / "offload")}
    _skip_where_the_bridge_refuses_disk(str(folder), **options)
    offloaded = cw_lens.load_model(str(folder), **options)
    return arch.name, resident, offloaded


def _skip_where_the_bridge_refuses_disk(folder: str, **options) -> None:
    # TransformerLens 3.x's bridge refuses disk offload itself: cw_lens must say so clearly
    if _TL_MAJOR < 4:
        with pytest.raises(UnsupportedModelError, match="refuses this device_map"):
            cw_lens.load_model(folder, **options)
        pytest.skip("TransformerLens 3.x's bridge refuses disk offload (the refusal is asserted)")


def test_an_offloaded_model_gives_the_resident_results_bit_for_bit(pair):
    name, resident, offloaded = pair
    assert on_meta(offloaded), "nothing was offloaded: the test would prove nothing"
    assert not on_meta(resident)
    names = None if name in EVERY_ANALYSIS else WEIGHT_READERS
    expected, got = analyses(resident, names), analyses(offloaded, names)
    for analysis in expected:
        assert_same(got[analysis], expected[analysis], analysis)
    assert on_meta(offloaded), "the weights read outside the forward passes stayed in memory"


def test_device_map_auto_with_max_memory_offloads_and_gives_the_resident_results(tmp_path):
    # how users fit a model: device_map="auto" under a max_memory too small for it, so that
    # accelerate itself decides what goes to disk
    arch = next(a for a in ARCHS if a.name == "Qwen2")
    hf = hf_model(arch, seed=1, dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    size = sum(p.numel() * 4 for p in hf.parameters())
    resident = cw_lens.load_model(str(tmp_path))
    options = {
        "device_map": "auto",
        "max_memory": {"cpu": size // 3},
        "offload_folder": str(tmp_path / "offload"),
    }
    _skip_where_the_bridge_refuses_disk(str(tmp_path), **options)
    offloaded = cw_lens.load_model(str(tmp_path), **options)
    assert on_meta(offloaded), "accelerate offloaded nothing: the test would prove nothing"
    expected, got = analyses(resident, WEIGHT_READERS), analyses(offloaded, WEIGHT_READERS)
    for analysis in expected:
        assert_same(got[analysis], expected[analysis], analysis)


def test_read_weights_copies_offloaded_weights_that_outlive_the_context(pair):
    _, resident, offloaded = pair
    attn = offloaded.blocks[-1].attn
    names = ("W_Q", "W_K", "W_V", "W_O", "b_V", "b_O")
    got = read_weights(attn, names, root=offloaded)
    want = read_weights(resident.blocks[-1].attn, names, root=resident)
    assert got["W_O"].device.type == "cpu" and on_meta(attn)
    assert_same(got, want)
    # a copy, not the weights map's tensor
    with resident_weights(attn, root=offloaded) as keep:
        inside = attn.W_O
        kept = keep(inside)
        assert kept.data_ptr() != inside.data_ptr()


def test_the_layer_weights_say_which_layers_are_offloaded(pair):
    """`output_weights` learns whether a layer is offloaded from the walk that reads it (one
    walk, not two): it agrees with `is_offloaded`, which is True for the layer on disk only,
    and a copy is kept only for resident layers (`capture`)."""
    from cw_lens.models.access import model_access

    _, resident, offloaded = pair
    flags = [
        model_access(offloaded).output_weights(i).offloaded for i in range(len(offloaded.blocks))
    ]
    assert flags == [is_offloaded(b.attn, root=offloaded) for b in offloaded.blocks]
    assert any(flags) and not all(flags), flags
    assert not any(
        model_access(resident).output_weights(i).offloaded for i in range(len(resident.blocks))
    )


def test_nested_reads_leave_the_outer_weights_in():
    hf = _offloaded_hf(tiny_llama_hf(seed=1), _CountingMap)
    bridge = _wrap(hf, "LlamaForCausalLM", "tiny-llama-streamed")
    attn = bridge.blocks[0].attn
    with resident_weights(attn, root=bridge) as keep:
        outer = keep(attn.W_O)
        inner = read_weights(attn, ("W_O",), root=bridge)["W_O"]
        assert not on_meta(attn), "the inner context sent the outer weights back to meta"
        assert_same(inner, outer)
    assert on_meta(attn)


# ------------------------------------------------------- hooks as the GGUF streaming loader sets


class _CountingMap(Mapping):
    """A lazy weights map (as the GGUF loader's): every read makes a fresh tensor, counted."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state, self.reads = state, Counter()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads[name] += 1
        return self.state[name].clone()

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def _offloaded_hf(hf: torch.nn.Module, map_class: type, *, wrap: bool = False):
    """`hf` with every decoder layer offloaded to a lazy weights map, as
    `cw_lens.models.gguf_stream` does; `wrap` puts each offload hook inside a SequentialHook."""
    from accelerate.hooks import ModelHook, add_hook_to_module, attach_align_device_hook

    weights = map_class({k: v.detach().clone() for k, v in hf.state_dict().items()})
    for index, layer in enumerate(hf.model.layers):
        attach_align_device_hook(
            layer,
            execution_device=torch.device("cpu"),
            offload=True,
            weights_map=weights,
            module_name=f"model.layers.{index}",
        )
        if wrap:
            for module in layer.modules():
                if hasattr(module, "_hf_hook"):
                    add_hook_to_module(module, ModelHook(), append=True)
    hf._weights = weights
    return hf


@functools.cache
def _resident_contributions(kind: str) -> cw_lens.ContributionResult:
    resident = _wrap(tiny_llama_hf(seed=1), "LlamaForCausalLM", "tiny-llama-streamed")
    return cw_lens.contribution_weights(resident, TEXTS, kind=kind)


@pytest.mark.parametrize("wrap", [False, True], ids=["hook", "sequential-hook"])
def test_a_lazy_weights_map_gives_the_resident_results_bit_for_bit(wrap):
    hf = _offloaded_hf(tiny_llama_hf(seed=1), _CountingMap, wrap=wrap)
    streamed = _wrap(hf, "LlamaForCausalLM", "tiny-llama-streamed")
    assert on_meta(streamed)
    if wrap:
        hook = hf.model.layers[0].self_attn.o_proj._hf_hook
        assert type(hook).__name__ == "SequentialHook"
    for kind in ("intra", "inter"):
        got = cw_lens.contribution_weights(streamed, TEXTS, kind=kind)
        assert_same(got, _resident_contributions(kind), kind)
    # inside a pass, W_O is read where hook_z fires, inside the output projection's bridge
    # call, which has brought its weights in (TransformerLens's align_module_device): cw_lens
    # adds no read of the weights map to the forward's. It sees no SequentialHook, so there
    # cw_lens reads W_O once per layer itself. The pass stops inside the last layer's output
    # projection, before the projection's own forward reads it.
    o_proj = [f"model.layers.{layer}.self_attn.o_proj.weight" for layer in (0, 1)]
    tokens = streamed.to_tokens(TEXTS[0])
    hf._weights.reads.clear()
    streamed(tokens)
    forward = [hf._weights.reads[name] for name in o_proj]
    hf._weights.reads.clear()
    cw_lens.contribution_weights(streamed, tokens)
    extra = 1 if wrap else 0
    expected = [forward[0] + extra, forward[1] - 1 + extra]
    if _TL_MAJOR >= 4:  # 3.x's bridge reads the projection in its own way (and refuses disk)
        assert [hf._weights.reads[name] for name in o_proj] == expected
    assert on_meta(streamed)
    # the offloaded layers' W_O copies are not kept across passes (memory flat in depth)
    batch, weights = prepare_inputs(streamed, TEXTS), {}
    run_layers(streamed, batch, lambda acts: None, layers=[0, 1], weights=weights)
    assert weights == {}
    # outside a pass, once per read
    hf._weights.reads.clear()
    cw_lens.models.weight_processing.w_o_is_centred(streamed)
    assert [hf._weights.reads[name] for name in o_proj] == [1, 1]


def _plain(name: str) -> str:
    """A parameter name without the bridge's wrappers (verify_model unwraps them for a pass)."""
    return name.replace("_original_component.", "")


class _PlainNames(Mapping):
    """A weights map that answers to a name with or without the bridge's wrappers."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[_plain(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def test_an_ancestor_hook_that_places_its_submodules_is_found():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    resident = _wrap(tiny_llama_hf(seed=2), "LlamaForCausalLM", "tiny-llama-placed")
    placed = _wrap(tiny_llama_hf(seed=2), "LlamaForCausalLM", "tiny-llama-placed")
    for block in placed.blocks:
        layer = block.original_component  # the Hugging Face decoder layer
        state = {_plain(name): p.detach().clone() for name, p in layer.named_parameters()}
        hook = AlignDevicesHook(
            execution_device="cpu", offload=True, weights_map=_PlainNames(state),
            place_submodules=True,
        )  # fmt: skip
        add_hook_to_module(layer, hook)
    assert on_meta(placed)
    attn = placed.blocks[0].attn
    assert "_hf_hook" not in vars(attn.o.original_component)  # the hook is on the layer
    with pytest.raises((NotImplementedError, UnsupportedModelError)):
        read_weights(attn, ("W_O",))  # without the root, the ancestor's hook is not found
    assert_same(
        read_weights(attn, ("W_O",), root=placed),
        read_weights(resident.blocks[0].attn, ("W_O",), root=resident),
    )
    for kind in ("intra", "inter"):
        want = cw_lens.contribution_weights(resident, TEXTS, kind=kind)
        assert_same(cw_lens.contribution_weights(placed, TEXTS, kind=kind), want, kind)


def test_a_weight_on_meta_without_a_hook_is_refused():
    with torch.device("meta"):
        linear = torch.nn.Linear(2, 2)
    with pytest.raises(UnsupportedModelError, match="meta device and no accelerate"):
        read_weights(linear, ("weight",))
