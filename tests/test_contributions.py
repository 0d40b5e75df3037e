"""contribution_weights on tiny random bridges (Llama-GQA and GPT-2) against dense references."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from reference import assert_rows_close, causal_rows, model_reference

import cw_lens
from cw_lens.core.errors import InputError
from cw_lens.models.testing import random_tokens

FIELDS = ("attention", "weights", "cosine", "relative_norm", "value_norm", "value_norm_output")


@pytest.mark.parametrize("kind", ["intra", "inter"])
def test_matches_dense_reference_on_tiny_models(tiny, kind):
    tokens = random_tokens(tiny, 2, 14, seed=3)
    result = cw_lens.contribution_weights(tiny, tokens, kind=kind, query_chunk=5)
    valid = causal_rows(14)[None, None]
    for layer in range(tiny.cfg.n_layers):
        ref = model_reference(tiny, tokens, layer, kind)
        for field in FIELDS:
            got = getattr(result, field)[:, layer]
            rows = (1, -1) if kind == "inter" and field in ("weights", "cosine") else (-1,)
            assert_rows_close(
                got, ref[field], 1e-5, valid, what=f"L{layer} {field} {kind}", row_dims=rows
            )


def test_layer_output_reconstructs_hook_attn_out(tiny):
    """methods § Notation invariant: o_i + b_O == blocks.{l}.hook_attn_out."""
    tokens = random_tokens(tiny, 2, 11, seed=4)
    for layer in range(tiny.cfg.n_layers):
        ref = model_reference(tiny, tokens, layer)
        rebuilt = ref["layer_output"] + (0 if ref["b_O"] is None else ref["b_O"])
        assert torch.allclose(rebuilt, ref["attn_out"], atol=1e-5, rtol=1e-5)


def streamed_weights(model, tokens, kind):
    """Weights per layer as the streaming unit computes them (one query block)."""
    out = {}

    def keep(lc):
        out[lc.layer] = lc.weights(kind).clone()

    cw_lens.stream_contributions(model, tokens, keep, query_chunk=1000)
    return out


def test_rows_sum_to_one_and_factors_multiply_back(tiny):
    tokens = random_tokens(tiny, 1, 16, seed=5)
    intra = cw_lens.contribution_weights(tiny, tokens, kind="intra")
    inter = cw_lens.contribution_weights(tiny, tokens, kind="inter")
    assert torch.allclose(intra.weights.sum(-1), torch.ones(()), atol=1e-4)
    assert torch.allclose(inter.weights.sum((-1, 2)), torch.ones(()), atol=1e-4)
    # the result derives weights as attention * relative_norm * cosine; the stream computes
    # them as alpha <pv_j, o_i> / ||o_i||^2 in one product: the two must agree
    for r in (intra, inter):
        streamed = streamed_weights(tiny, tokens, r.kind)
        for layer, w in streamed.items():
            assert torch.allclose(r.weights[:, layer], w, atol=1e-6, rtol=1e-5)
    assert (inter.weights < 0).any(), "random heads should interfere destructively somewhere"


def test_padded_batch_equals_texts_one_by_one(tiny):
    texts = ["a short one", "a considerably longer sentence here", "mid length text"]
    batch = cw_lens.contribution_weights(tiny, texts, kind="inter", batch_size=2)
    assert batch.mask.sum(-1).tolist() == [len(t) + 1 for t in texts]
    for i, text in enumerate(texts):
        single = cw_lens.contribution_weights(tiny, text, kind="inter")
        n = len(text) + 1
        for field in ("weights", "attention", "cosine", "relative_norm"):
            got = getattr(batch, field)[i, :, :, :n, :n]
            assert torch.allclose(got, getattr(single, field)[0], atol=2e-6, rtol=1e-5), field
        # padded query rows are NaN, keys after the query are 0
        assert batch.weights[i, :, :, n:, :n].isnan().all()
        assert (batch.weights[i, :, :, :n, n:] == 0).all()


def test_left_padded_tokens_with_mask_are_realigned(llama):
    texts = ["hi there", "hello"]
    single = cw_lens.contribution_weights(llama, texts[1])
    tokens = llama.to_tokens(texts, padding_side="left")
    mask = (tokens != llama.tokenizer.pad_token_id).long()
    result = cw_lens.contribution_weights(llama, tokens, attention_mask=mask)
    n = single.tokens.shape[1]
    assert torch.equal(result.tokens[1, :n], single.tokens[0])
    assert torch.allclose(result.weights[1, :, :, :n, :n], single.weights[0], atol=2e-6)


def test_from_cache_equals_streamed(tiny):
    tokens = random_tokens(tiny, 2, 10, seed=6)
    names = cw_lens.cache_names(list(range(tiny.cfg.n_layers)))
    _, cache = tiny.run_with_cache(tokens, names_filter=names)
    # only what contribution weights read (the cache lists aliases of the same tensors too)
    assert len({cache[key].data_ptr() for key in cache.keys()}) == len(names)
    assert all(cache[name] is not None for name in names)
    for kind in ("intra", "inter"):
        full = cw_lens.contribution_weights(tiny, tokens, kind=kind)
        for layer in range(tiny.cfg.n_layers):
            one = cw_lens.contribution_weights_from_cache(
                cache, tiny, layer=layer, kind=kind, tokens=tokens
            )
            assert one.layers == [layer]
            for field in FIELDS:
                assert torch.allclose(
                    getattr(one, field)[:, 0],
                    getattr(full, field)[:, layer],
                    atol=1e-6,
                    rtol=1e-5,
                    equal_nan=True,
                ), field


def test_head_and_layer_subsets_equal_slices_of_the_full_result(llama):
    tokens = random_tokens(llama, 1, 9, seed=7)
    full = cw_lens.contribution_weights(llama, tokens, kind="inter")
    part = cw_lens.contribution_weights(llama, tokens, kind="inter", layers=[-1], heads=[3, 1])
    assert part.layers == [1] and part.heads == [1, 3]
    assert torch.allclose(part.weights[:, 0], full.weights[:, 1, [1, 3]], atol=1e-6)


def test_chunking_and_buffer_reuse_do_not_change_results(llama):
    tokens = random_tokens(llama, 2, 21, seed=8)
    collected = {}

    def keep(lc):
        collected.setdefault(lc.layer, []).append(lc.weights("intra").clone())

    cw_lens.stream_contributions(llama, tokens, keep, query_chunk=4, reuse_buffers=True)
    chunks = collected[0]
    assert [c.shape[2] for c in chunks] == [4, 4, 4, 4, 4, 1]
    assert [c.shape[3] for c in chunks] == [4, 8, 12, 16, 20, 21]
    whole = cw_lens.contribution_weights(llama, tokens, query_chunk=1000)
    stitched = torch.zeros_like(whole.weights[:, 0])
    for i, c in enumerate(chunks):
        stitched[:, :, 4 * i : 4 * i + c.shape[2], : c.shape[3]] = c
    assert torch.allclose(stitched, whole.weights[:, 0], atol=1e-6)


def test_stream_memory_holds_one_layer(llama):
    """The consumer sees layers in order, one at a time, during a single pass."""
    seen = []
    cw_lens.stream_contributions(llama, "abc", lambda lc: seen.append(lc.layer))
    assert seen == [0, 1]


def test_result_helpers(llama):
    result = cw_lens.contribution_weights(llama, "hello world", kind="inter")
    df = result.to_dataframe(layer=1, head=2)
    n = result.tokens.shape[1]
    assert len(df) == n * (n + 1) // 2
    assert set(FIELDS) <= set(df.columns)
    row = df[(df["query"] == 5) & (df["key"] == 2)].iloc[0]
    assert row["weights"] == pytest.approx(float(result.weights[0, 1, 2, 5, 2]))
    assert row["key_token"] == result.str_tokens[0][2]
    top = result.top(k=3)
    assert len(top) == 3 and (top["query"] == n - 1).all()
    assert top["weights"].is_monotonic_decreasing
    assert top["weights"].iloc[0] == pytest.approx(float(result.weights[0, :, :, -1].max()))
    summed = result.top(k=2, sum_heads=True)
    assert "head" not in summed.columns
    fig = result.plot(layer=1, head=0)
    assert len(fig.axes) >= 2


# ---------------------------------------------------------------- errors name the fix


@pytest.mark.parametrize(
    ("inputs", "kwargs", "message"),
    [
        ("", {}, "empty"),
        ("   ", {}, "empty"),
        (["ok", ""], {}, "empty"),
        ([], {}, "empty"),
        ("x" * 300, {}, "context is 256 tokens"),
        ("abc", {"layers": [2]}, "Layer 2 is out of range"),
        ("abc", {"heads": [4]}, "Head 4 is out of range"),
        ("abc", {"kind": "outer"}, "kind must be"),
    ],
)
def test_bad_inputs_raise_clear_errors(llama, inputs, kwargs, message):
    with pytest.raises(InputError, match=message):
        cw_lens.contribution_weights(llama, inputs, **kwargs)


def test_padding_without_mask_is_rejected(llama):
    tokens = llama.to_tokens(["hi there", "hello"])  # right-padded with <|pad|>
    with pytest.raises(InputError, match="attention_mask"):
        cw_lens.contribution_weights(llama, tokens)
    only_pad = torch.tensor([[256, 1, 2]])
    with pytest.raises(InputError, match="only padding"):
        cw_lens.contribution_weights(llama, only_pad, attention_mask=torch.zeros(1, 3))


def test_cache_errors(llama, gpt2):
    tokens = random_tokens(llama, 1, 6)
    _, cache = llama.run_with_cache(tokens)
    with pytest.raises(InputError, match="another model"):
        cw_lens.contribution_weights_from_cache(cache, gpt2, layer=0)
    partial = {k: v for k, v in cache.items() if "hook_z" not in k}
    with pytest.raises(InputError, match=r"has no 'blocks\.0\.attn\.hook_z'"):
        cw_lens.contribution_weights_from_cache(partial, llama, layer=0)
    broken = dict(cache.items())
    broken["blocks.0.attn.hook_v"] = broken["blocks.0.attn.hook_v"].clone()
    broken["blocks.0.attn.hook_v"][0, 1, 0, 0] = float("nan")
    with pytest.raises(InputError, match="NaN or inf"):
        cw_lens.contribution_weights_from_cache(broken, llama, layer=0)
    with pytest.raises(InputError, match="out of range"):
        cw_lens.contribution_weights_from_cache(cache, llama, layer=5)


def test_more_bad_inputs_name_the_fix(llama):
    with pytest.raises(InputError, match="query_chunk must be a positive integer"):
        cw_lens.contribution_weights(llama, "abc", query_chunk=-3)
    with pytest.raises(InputError, match="query_chunk must be a positive integer"):
        cw_lens.contribution_weights(llama, "abc", query_chunk=0)
    with pytest.raises(InputError, match="Layers must be an integer or a list"):
        cw_lens.contribution_weights(llama, "abc", layers=1.0)
    with pytest.raises(InputError, match="consumer must be a function"):
        cw_lens.stream_contributions(llama, "abc", None)
    with pytest.raises(InputError, match="containing int"):
        cw_lens.contribution_weights(llama, ["ok", 3])
    result = cw_lens.contribution_weights(llama, "abc", layers=[1])
    with pytest.raises(InputError, match="batch must be a row index"):
        result.to_dataframe(batch=3)
    with pytest.raises(InputError, match="Layer 0 is not in this result"):
        result.plot(layer=0)
    with pytest.raises(InputError, match="Head 9 is not in this result"):
        result.plot(layer=1, head=9)
    with pytest.warns(UserWarning, match="not a share"):
        result.top(sum_heads=True)


def test_top_reads_queries_like_the_flow_results(llama):
    """One row resolver for every result: negative queries count from the end of the row's
    real tokens, a query past them or a bool batch is refused."""
    result = cw_lens.contribution_weights(llama, ["a longer first text", "short"])
    n = int(result.mask[1].sum())
    assert n < result.tokens.shape[1]  # row 1 is padded
    last = result.top(batch=1, k=4)
    assert (last["query"] == n - 1).all()
    pd.testing.assert_frame_equal(result.top(batch=1, query=-1, k=4), last)
    assert (result.top(batch=1, query=-n, k=4)["query"] == 0).all()
    with pytest.raises(InputError, match=f"outside the {n} real positions of row 1"):
        result.top(batch=1, query=n)
    with pytest.raises(InputError, match="outside"):
        result.top(batch=1, query=-n - 1)
    with pytest.raises(InputError, match="batch must be a row index"):
        result.top(batch=True)


def test_text_containing_the_pad_token_is_text_not_padding(llama):
    pad = llama.tokenizer.pad_token
    result = cw_lens.contribution_weights(llama, f"answer{pad}")
    assert result.tokens[0, -1].item() == llama.tokenizer.pad_token_id
    assert result.mask.all()


def test_a_block_kept_from_the_consumer_stays_valid(llama):
    """What `stream_contributions` hands its consumer is the consumer's to keep: fields taken
    inside the call and fields first read after the stream has moved on (over blocks of other
    layers and query rows) equal the same blocks streamed one at a time."""
    tokens = random_tokens(llama, 2, 21, seed=8)
    kept, taken = [], []

    def keep(lc):
        kept.append(lc)
        taken.append((lc.weights("inter"), lc.cosine("intra"), lc.value_norm()))

    cw_lens.stream_contributions(llama, tokens, keep, query_chunk=4, progress=False)
    later = [(lc.weights("intra"), lc.relative_norm("inter")) for lc in kept]
    fresh = []
    cw_lens.stream_contributions(
        llama,
        tokens,
        lambda lc: fresh.append(
            tuple(
                t.clone()
                for t in (
                    lc.weights("inter"),
                    lc.cosine("intra"),
                    lc.value_norm(),
                    lc.weights("intra"),
                    lc.relative_norm("inter"),
                )
            )
        ),
        query_chunk=4,
        progress=False,
        reuse_buffers=True,
    )
    assert len(kept) == len(fresh) == 12  # 2 layers x 6 query blocks
    for got_in, got_after, want in zip(taken, later, fresh, strict=True):
        for got, ref in zip((*got_in, *got_after), want, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


def test_a_view_block_must_be_copied_to_be_kept(llama):
    """With `reuse_buffers=True` the block is a view valid only during the call: one read
    after the stream moved on raises instead of reading overwritten buffers, and
    `detach_copy()` taken inside the call keeps the block's values."""
    tokens = random_tokens(llama, 2, 21, seed=8)
    views, copies, want = [], [], []

    def keep(lc):
        views.append(lc)
        want.append(lc.weights("inter").clone())
        copies.append(lc.detach_copy())

    cw_lens.stream_contributions(
        llama, tokens, keep, query_chunk=4, progress=False, reuse_buffers=True
    )
    for copy, ref in zip(copies, want, strict=True):
        assert not copy.is_view
        torch.testing.assert_close(copy.weights("inter"), ref, rtol=0, atol=0, equal_nan=True)
    assert views[-1].is_view
    with pytest.raises(InputError, match="detach_copy"):
        views[0].weights("inter")
    with pytest.raises(InputError, match="detach_copy"):
        views[0].detach_copy()


def test_blocks_given_to_on_block_stay_valid(llama):
    """`contribution_weights(on_block=...)`: a kept block still equals the result's layer."""
    tokens = random_tokens(llama, 2, 21, seed=8)
    kept = []
    result = cw_lens.contribution_weights(
        llama, tokens, kind="inter", query_chunk=4, on_block=kept.append
    )
    assert len(kept) == 12
    for lc in kept:
        rows, keys = lc.queries, lc.keys
        ref = result.weights[:, result.layers.index(lc.layer), :, rows, keys]
        torch.testing.assert_close(lc.weights("inter"), ref, atol=1e-6, rtol=1e-5, equal_nan=True)
