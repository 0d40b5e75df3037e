"""GGUF headers checked against the file's tensors before anything is built (issue 51, item 5).

Each test edits one header value of a tiny GGUF file (80 KB, written by
`cw_lens.models.gguf_writer`) in place, with `gguf`'s own reader opened for writing (as
llama.cpp's `gguf_set_metadata.py` does), and loads it both ways: resident (the float32 cache)
and layer-streamed. 0.4.1 hung on a block count of 10^5 or 10^9, ran for minutes at 10^4,
allocated 1 TB for a 10^9-wide stream when streaming, raised a raw `IndexError` for a BOS id
past the vocabulary, and left the cache's lock file and digest memo behind after a failed load.
"""

from __future__ import annotations

import resource
import shutil
import tracemalloc
from pathlib import Path

import pytest

import cw_lens
from cw_lens.core.errors import ModelLoadError

# cw_lens writes GGUF files with transformers 5's name maps and streams them on a
# TransformerBridge (as tests/test_gguf_stream.py)
pytest.importorskip("transformer_lens.model_bridge", reason="GGUF streaming needs a bridge")

WIDE = 10**9
BOTH = pytest.mark.parametrize("layer_streaming", [False, True], ids=["resident", "streamed"])


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from cw_lens.models.gguf_writer import random_hf_model, tiny_config, write_gguf

    return write_gguf(
        random_hf_model(tiny_config("llama")), tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CW_LENS_CACHE", str(root))
    return root


def _with_field(source: Path, folder: Path, key: str, value: int) -> Path:
    """A copy of `source` whose header field `key` holds `value` (same type, same size)."""
    import gguf

    path = folder / f"{key.replace('.', '_')}-{value}.gguf"
    shutil.copyfile(source, path)
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()
    del reader, field
    return path


def _files_left(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def _refusal(path: Path, layer_streaming: bool) -> str:
    with pytest.raises(ModelLoadError) as caught:
        cw_lens.load_model(path, layer_streaming=layer_streaming)
    return str(caught.value)


def _refusal_and_peak(path, layer_streaming):
    """The refusal's message, and the peak of Python's allocations while it was raised."""
    tracemalloc.start()
    try:
        message = _refusal(path, layer_streaming)
        return message, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------ the rows of the issue


@BOTH
@pytest.mark.parametrize("blocks", [10**9, 10**5], ids=["1e9", "1e5"])
def test_a_block_count_the_tensors_do_not_have_is_refused_before_building(
    gguf_file, tmp_path, cache, layer_streaming, blocks
):
    """0.4.1 built (or looped over) 10^5 or 10^9 layers from the header: it hung."""
    bad = _with_field(gguf_file, tmp_path, "llama.block_count", blocks)
    message = _refusal(bad, layer_streaming)
    assert str(bad) in message and f"llama.block_count is {blocks}" in message
    assert "tensors for 2 decoder blocks (blk.0 to blk.1)" in message
    assert _files_left(cache) == []


@BOTH
def test_a_block_count_of_ten_thousand_is_refused_in_bounded_memory(
    gguf_file, tmp_path, cache, layer_streaming
):
    """0.4.1 ran for over 200 s with the resident memory rising to 3.9 GB."""
    bad = _with_field(gguf_file, tmp_path, "llama.block_count", 10**4)
    _refusal(bad, layer_streaming)  # imports and first-use caches, outside the measurement
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    message, peak = _refusal_and_peak(bad, layer_streaming)
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert "llama.block_count is 10000" in message
    assert peak < 32 * 2**20, f"Python allocations peaked at {peak / 2**20:.0f} MiB"
    assert rss_growth < 256 * 2**10, f"the peak RSS rose by {rss_growth / 2**10:.0f} MiB"


@BOTH
@pytest.mark.parametrize(
    ("key", "tensors_say"),
    [
        ("llama.embedding_length", "token_embd.weight is 64 wide"),
        ("llama.feed_forward_length", "blk.0.ffn_gate.weight has shape [64, 128]"),
    ],
    ids=["embedding_length", "feed_forward_length"],
)
def test_a_width_the_tensors_do_not_have_is_refused_before_allocating(
    gguf_file, tmp_path, cache, layer_streaming, key, tensors_say
):
    """0.4.1's streamed load raised a raw RuntimeError from a 1 TB (256 GB) allocation."""
    bad = _with_field(gguf_file, tmp_path, key, WIDE)
    message, peak = _refusal_and_peak(bad, layer_streaming)
    assert str(bad) in message and f"{key} is {WIDE}" in message and tensors_say in message
    assert peak < 64 * 2**20, f"Python allocations peaked at {peak / 2**20:.0f} MiB"
    assert _files_left(cache) == []


@BOTH
def test_a_bos_id_past_the_vocabulary_is_refused(gguf_file, tmp_path, cache, layer_streaming):
    """0.4.1's streamed load raised a raw IndexError in the tokenizer."""
    bad = _with_field(gguf_file, tmp_path, "tokenizer.ggml.bos_token_id", WIDE)
    message = _refusal(bad, layer_streaming)
    assert f"tokenizer.ggml.bos_token_id is {WIDE}" in message
    assert "the vocabulary has 265 tokens (ids 0 to 264)" in message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("llama.block_count", 10**5),
        ("llama.embedding_length", WIDE),
        ("llama.feed_forward_length", WIDE),
        ("llama.attention.head_count", 6),
        ("llama.attention.head_count_kv", 1),
        ("tokenizer.ggml.eos_token_id", 265),
        ("tokenizer.ggml.padding_token_id", WIDE),
    ],
)
def test_both_load_paths_give_the_same_error(gguf_file, tmp_path, cache, key, value):
    bad = _with_field(gguf_file, tmp_path, key, value)
    resident, streamed = _refusal(bad, False), _refusal(bad, True)
    assert resident == streamed
    assert f"the header's {key} is {value}, but " in resident


@BOTH
def test_a_failed_load_leaves_no_lock_and_no_memo(
    gguf_file, tmp_path, cache, monkeypatch, layer_streaming
):
    """A header refused, and (resident) a build that fails after the header passed: nothing
    is left in the cache, neither the `.lock` file nor the digest memo nor a folder."""
    bad = _with_field(gguf_file, tmp_path, "llama.embedding_length", WIDE)
    _refusal(bad, layer_streaming)
    assert _files_left(cache) == []
    if layer_streaming:
        return
    from cw_lens.models import gguf_cache

    def fails(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_cache, "_write_neutral_files", fails)
    with pytest.raises(OSError, match="disk full"):
        cw_lens.load_model(gguf_file, layer_streaming=False)
    assert _files_left(cache) == []
    monkeypatch.undo()
    monkeypatch.setenv("CW_LENS_CACHE", str(cache))
    assert cw_lens.load_model(gguf_file, layer_streaming=False).cfg.n_layers == 2


# ------------------------------------------------------------------ what is still accepted


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("llama", {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 3}),
        ("mistral", {"num_key_value_heads": 1}),
        ("qwen2", {}),
        ("gemma2", {}),
    ],
)
def test_headers_that_match_their_tensors_pass(tmp_path, arch, overrides):
    from cw_lens.models.gguf_header import check_gguf_header
    from cw_lens.models.gguf_writer import random_hf_model, tiny_config, write_gguf

    hf = random_hf_model(tiny_config(arch, **overrides))
    reader = check_gguf_header(write_gguf(hf, tmp_path / f"{arch}.gguf"))
    assert len(reader.tensors) > 0


@pytest.mark.model
def test_the_embedded_model_header_passes():
    from cw_lens.models.gguf_header import check_gguf_header
    from cw_lens.models.load import embedded_gguf_path

    reader = check_gguf_header(embedded_gguf_path())
    assert int(reader.fields["llama.block_count"].contents()) == 30


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("llama.attention.head_count", 6, "not a whole number of heads"),
        ("llama.attention.head_count_kv", 3, "4 query heads do not share it in whole groups"),
        ("llama.attention.head_count_kv", 4, "blk.0.attn_k.weight has shape [64, 32]"),
        ("llama.block_count", 1, "tensors for 2 decoder blocks"),
        ("llama.block_count", 0, "must be at least 1"),
        ("llama.context_length", 0, "must be at least 1"),
        ("tokenizer.ggml.eos_token_id", 265, "ids 0 to 264"),
    ],
)
def test_each_count_is_checked(gguf_file, tmp_path, key, value, says):
    from cw_lens.models.gguf_header import check_gguf_header

    with pytest.raises(ModelLoadError, match=f"{key} is {value}") as caught:
        check_gguf_header(_with_field(gguf_file, tmp_path, key, value))
    assert says in str(caught.value)


def test_overlapping_tensors_are_refused(gguf_file, tmp_path):
    """Two tensor infos pointing at the same bytes would let a small file claim the same data
    many times over (de-quantised once per tensor)."""
    import gguf

    from cw_lens.models.gguf_header import open_gguf

    bad = tmp_path / "overlap.gguf"
    shutil.copyfile(gguf_file, bad)
    reader = gguf.GGUFReader(str(bad), "r+")
    first, second = reader.tensors[1].field, reader.tensors[2].field
    offset = first.parts[first.data[-1]][0]  # the first tensor's offset, relative to the data
    second.parts[second.data[-1]][0] = offset
    reader.data.flush()
    del reader, first, second
    with pytest.raises(ModelLoadError, match="overlap"):
        open_gguf(bad)
