"""Layer-streamed GGUF models against transformers' own de-quantisation, and the embedded model
streamed against its resident cache.

The tiny files are written here (`cw_lens.models.gguf_writer`): llama, qwen2 and gemma2 with
Q8_0, Q4_0, Q4_1, F16 and F32 tensors, and K-quants (Q4_K, Q6_K) from random valid blocks. The
reference is `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`, which de-quantises
the whole file with transformers' loader: an independent reader of the same file.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

import cw_lens
from cw_lens.core.errors import InputError, ModelLoadError, UnsupportedModelError
from cw_lens.models.gguf_writer import random_hf_model, tiny_config, write_gguf

# layer streaming runs on the bridge (TransformerLens 3.x and 4.x); the writer follows the
# transformers 5.x GGUF name maps
pytest.importorskip(
    "transformer_lens.model_bridge", reason="layer streaming needs a TransformerBridge"
)

FIELDS = ("weights", "attention", "relative_norm", "cosine", "output_norm", "head_output_norm")
TEXT = "the cat in the hat sat on the mat, then the end"


def _mixed_types(name: str, shape: tuple[int, ...]) -> str:
    # every quantisation gguf can write, spread over the tensors of a layer
    if len(shape) == 1:
        return "F32"
    if name.startswith("token_embd"):
        return "Q8_0"
    for part, kind in (("attn_q", "Q4_0"), ("attn_k", "Q4_1"), ("attn_v", "Q8_0")):
        if part in name:
            return kind
    if "ffn_down" in name:
        return "F16"
    return "Q4_1"


def _k_types(name: str, shape: tuple[int, ...]) -> str:
    if len(shape) == 1:
        return "F32"
    if shape[-1] % 256:
        return "Q8_0"
    return "Q6_K" if "ffn_down" in name or "attn_v" in name else "Q4_K"


FILES = {
    "llama-mixed": ("llama", _mixed_types, {}),
    "qwen2-mixed": ("qwen2", _mixed_types, {}),
    "gemma2-mixed": ("gemma2", _mixed_types, {}),
    "llama-kquants": ("llama", _k_types, {"hidden_size": 256, "intermediate_size": 256}),
}


@pytest.fixture(scope="module", params=sorted(FILES))
def gguf_file(request, tmp_path_factory):
    arch, types, overrides = FILES[request.param]
    hf = random_hf_model(tiny_config(arch, **overrides), seed=3)
    folder = tmp_path_factory.mktemp(request.param)
    return write_gguf(hf, folder / f"{request.param}.gguf", tensor_types=types)


@pytest.fixture(scope="module")
def pair(gguf_file):
    """(the transformers-loaded reference as a bridge, the layer-streamed bridge)."""
    from transformers import AutoModelForCausalLM

    from cw_lens.models.gguf_stream import gguf_tokenizer
    from cw_lens.models.load import _boot

    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent),
        gguf_file=gguf_file.name,
        dtype=torch.float32,
        attn_implementation="eager",
    )
    reference = _boot(gguf_file.stem, hf_model=hf.eval(), tokenizer=gguf_tokenizer(gguf_file))
    streamed = cw_lens.load_model(gguf_file, layer_streaming=True)
    return reference, streamed


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))


def test_streamed_logits_equal_transformers_loader(pair):
    reference, streamed = pair
    with torch.inference_mode():
        assert torch.equal(reference(TEXT), streamed(TEXT))


def test_one_layer_at_a_time(pair):
    _, streamed = pair
    weights = streamed._cw_lens_gguf_weights
    before = weights.layer_loads
    with torch.inference_mode():
        streamed(TEXT)
    # every decoder layer de-quantised exactly once per forward, although TransformerLens reads
    # some weights twice
    assert weights.layer_loads - before == streamed.cfg.n_layers
    # between forwards at most one layer's float32 weights are held
    assert weights._cached_layer in (None, streamed.cfg.n_layers - 1)
    assert sum(t.numel() for t in weights._cache.values()) * 4 <= weights.layer_bytes(0)


@pytest.mark.parametrize("n_layers", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_verification_de_quantises_each_layer_once(tmp_path, monkeypatch, arch, n_layers):
    """`verify_model` reads every check in one probe pass (`cw_lens.models.verify_probe`), with
    the unbridged Hugging Face forward in lockstep with it: each decoder layer is de-quantised
    once, in order (the passes of 0.4.0 de-quantised 12 layers at 2 layers, 21 at 4). Gemma 2's
    post-attention norm, which the flow checks read, is read inside the pass too."""
    from cw_lens.models.gguf_stream import streamed_weights

    hf = random_hf_model(tiny_config(arch, num_hidden_layers=n_layers), seed=3)
    model = cw_lens.load_model(write_gguf(hf, tmp_path / f"{arch}.gguf"), layer_streaming=True)
    weights = streamed_weights(model)
    loaded = []
    layer_weights = weights.layer_weights

    def spy(layer):
        before = weights.layer_loads
        got = layer_weights(layer)
        if weights.layer_loads != before:
            loaded.append(layer)
        return got

    monkeypatch.setattr(weights, "layer_weights", spy)
    before = weights.layer_loads
    report = cw_lens.verify_model(model)
    assert weights.layer_loads - before == n_layers
    assert loaded == list(range(n_layers))
    # every check ran, and passed
    assert report.ok and report.flow.startswith("exact"), report.summary_text()
    assert all(verdict.startswith("exact") for verdict in report.interventions.values())
    assert report.logits_vs_hf is not None and report.logits_vs_hf < 1e-5
    assert len(report.layers) == n_layers


def test_a_refusal_inside_the_probe_pass_leaves_the_streamed_bridge_whole(tmp_path):
    """A planted edit of `z` refuses the streamed model: its probe pass ends at the edited layer
    and the Hugging Face forward keeping step with it is stopped. No thread is left running, the
    bridge's components are back in the Hugging Face model and its logits are unchanged."""
    import threading

    hf = random_hf_model(tiny_config("llama"), seed=3)
    model = cw_lens.load_model(write_gguf(hf, tmp_path / "l.gguf"), layer_streaming=True)

    def bridged() -> int:
        return sum("transformer_lens" in type(m).__module__ for m in model.original_model.modules())

    components = bridged()
    with torch.inference_mode():
        clean = model(TEXT)
    threads = threading.active_count()

    def halve_z(z, hook):
        z = z.clone()
        z[:, 6:, 1] *= 0.5
        return z

    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_z", halve_z)]):
        report = cw_lens.verify_model(model, force=True)
    assert not report.ok and "pattern @ v != z" in report.problems[0]
    assert report.flow == "refused: the model failed verification"
    assert threading.active_count() == threads
    assert bridged() == components
    with torch.inference_mode():
        assert torch.equal(model(TEXT), clean)
    assert cw_lens.verify_model(model, force=True).ok


def test_streamed_analyses_equal_reference(pair):
    reference, streamed = pair
    for kind in ("intra", "inter"):
        ref = cw_lens.contribution_weights(reference, TEXT, kind=kind)
        got = cw_lens.contribution_weights(streamed, TEXT, kind=kind)
        for name in FIELDS:
            assert _equal(getattr(ref, name), getattr(got, name)), (kind, name)
    ref = cw_lens.sink_statistics(reference, [TEXT, TEXT[:30]], progress=False)
    got = cw_lens.sink_statistics(streamed, [TEXT, TEXT[:30]], progress=False)
    pd_ref, pd_got = ref.to_dataframe(), got.to_dataframe()
    assert pd_ref.shape == pd_got.shape
    assert pd_ref.equals(pd_got)


def test_resident_load_equals_streamed(pair, gguf_file, tmp_path, monkeypatch):
    # the other loader of a GGUF path: de-quantised once into the float32 cache
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path))
    _, streamed = pair
    resident = cw_lens.load_model(gguf_file, layer_streaming=False)
    assert not hasattr(resident, "_cw_lens_gguf_weights")
    with torch.inference_mode():
        assert torch.equal(resident(TEXT), streamed(TEXT))


def test_tokenizer_special_ids_follow_the_metadata(gguf_file):
    from cw_lens.models.gguf_stream import gguf_special_token_ids, gguf_tokenizer

    ids = gguf_special_token_ids(gguf_file)
    tokenizer = gguf_tokenizer(gguf_file)
    assert ids == {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    from cw_lens.data.inputs import prepare_inputs

    model = cw_lens.load_model(gguf_file, layer_streaming=True)
    assert int(prepare_inputs(model, "x").tokens[0, 0]) == ids["bos_token_id"]


def test_lm_head_streamed_equals_resident(tmp_path):
    hf = random_hf_model(tiny_config("qwen2"), seed=5)
    path = write_gguf(hf, tmp_path / "q.gguf")
    resident = cw_lens.load_model(path, layer_streaming=True)
    if int(version("transformer-lens").split(".")[0]) < 4:
        # TransformerLens 3.x gives the head a bias that a streamed head has no value for
        with pytest.raises(UnsupportedModelError, match=r"lm_head\.bias"):
            cw_lens.load_model(path, layer_streaming=True, lm_head="streamed")
        pytest.skip("TransformerLens 3.x: a streamed head is refused (the refusal is asserted)")
    streamed = cw_lens.load_model(path, layer_streaming=True, lm_head="streamed")
    weights = streamed._cw_lens_gguf_weights
    assert "lm_head.weight" not in weights._resident
    before = weights.head_loads
    with torch.inference_mode():
        assert torch.equal(resident(TEXT), streamed(TEXT))
    assert weights.head_loads - before == 1  # read twice by TransformerLens, de-quantised once
    assert weights.resident_bytes() < resident._cw_lens_gguf_weights.resident_bytes()


def test_streaming_refusals(tmp_path):
    hf = random_hf_model(tiny_config("llama"), seed=1)
    path = write_gguf(hf, tmp_path / "l.gguf")
    with pytest.raises(InputError, match="TransformerBridge"):
        cw_lens.load_model(path, layer_streaming=True, api="hooked")
    with pytest.raises(InputError, match="lm_head"):
        cw_lens.load_model(path, layer_streaming=True, lm_head="disk")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ModelLoadError):
        cw_lens.load_model(broken, layer_streaming=True)


def test_automatic_choice_streams_large_files(tmp_path, monkeypatch):
    from cw_lens.models import load as load_module
    from cw_lens.models.gguf_stream import gguf_float32_bytes

    hf = random_hf_model(tiny_config("llama"), seed=1)
    path = write_gguf(hf, tmp_path / "l.gguf")
    size = gguf_float32_bytes(path)
    assert size == 4 * sum(p.numel() for p in hf.parameters())
    monkeypatch.setattr(load_module, "available_memory", lambda device: 2 * size)
    assert load_module._streams(path, None, is_embedded=False)
    monkeypatch.setattr(load_module, "available_memory", lambda device: 8 * size)
    assert not load_module._streams(path, None, is_embedded=False)
    assert not load_module._streams(path, None, is_embedded=True)


def test_k_quants_are_read_as_gguf_defines_them(tmp_path):
    import gguf
    import numpy as np

    from cw_lens.models.gguf_writer import random_k_quant

    rng = np.random.default_rng(0)
    for qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
        blocks = random_k_quant((4, 512), qtype, rng)
        values = gguf.dequantize(blocks, qtype)
        assert values.shape == (4, 512) and np.isfinite(values).all()
        assert 0 < float(np.abs(values).max()) < 10 and float(values.std()) > 0


@pytest.mark.model
def test_embedded_model_streamed_equals_resident(smollm):
    """The embedded SmolLM2 through the layer-streamed path equals its resident float32 cache,
    bit for bit: the logits, every contribution field of both kinds (which read `W_O` outside
    the attention's own forward), and the corpus sink statistics."""
    from cw_lens.models.load import embedded_gguf_path

    streamed = cw_lens.load_model(embedded_gguf_path(), layer_streaming=True, device="cpu")
    text = ["The quick brown fox jumps over the lazy dog.", "Attention sinks, again."]
    with torch.inference_mode():
        assert torch.equal(smollm(text[0]), streamed(text[0]))
    weights = streamed._cw_lens_gguf_weights
    cw_lens.verify_model(streamed)  # once per model, before the first analysis
    for kind in ("intra", "inter"):
        ref = cw_lens.contribution_weights(smollm, text, kind=kind)
        before = weights.layer_loads
        got = cw_lens.contribution_weights(streamed, text, kind=kind)
        assert weights.layer_loads - before == streamed.cfg.n_layers  # one sweep, no re-reads
        for name in FIELDS:
            assert _equal(getattr(ref, name), getattr(got, name)), (kind, name)
    ref = cw_lens.sink_statistics(smollm, text, progress=False).to_dataframe()
    assert ref.equals(cw_lens.sink_statistics(streamed, text, progress=False).to_dataframe())
