"""Contribution flow on tiny random models of six architectures, against the dense float64
reference of ``flow_reference`` (pieces read from the Hugging Face modules themselves)."""

from __future__ import annotations

import importlib.metadata
import json
from importlib import resources
from pathlib import Path

import pytest
import torch
from apis import needs_bridge
from flow_reference import (
    dense_flow_reference,
    dense_route_edges,
    dense_token_matrix,
    tiny_model,
)

import cw_lens
from cw_lens.core.errors import InputError, UnsupportedModelError
from cw_lens.models.testing import random_tokens
from cw_lens.viz.routes import rerender_routes_page

ARCHS = ["llama", "gpt2", "neox", "gptj", "gemma2", "olmo2"]
PIECES = ("residual", "attention", "bias", "mlp")


TL_MAJOR = int(importlib.metadata.version("transformer-lens").split(".")[0])


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    if TL_MAJOR < 3:  # HookedTransformer: test_hooked_transformer_shares_match_a_dense_reference
        pytest.skip("the dense reference reads a bridge's HF modules; TransformerLens 2.x has none")
    model = tiny_model(request.param, n_layers=3)
    if request.param == "olmo2" and TL_MAJOR < 4:
        # TransformerLens 3.x's OLMo 2 bridge: hook_attn_out is not the post-norm attention
        # piece of the residual, so the flow checks must refuse it rather than give numbers
        with pytest.raises(UnsupportedModelError, match="attn_out"):
            cw_lens.residual_shares(model, random_tokens(model, 1, 8))
        pytest.skip("OLMo 2 bridge of TransformerLens 3.x: flow analyses refuse it (asserted)")
    return request.param, model


def row_close(got, want, rtol, what):
    """Row-relative comparison: each (batch, query) row against its largest entry."""
    got, want = got.double(), want.double()
    dims = tuple(range(1, want.dim())) if want.dim() > 2 else (-1,)
    if want.dim() == 4:  # [batch, head, query, key]: a row is (head, key) of one query
        scale = want.abs().amax((1, 3), keepdim=True)
    else:
        scale = want.abs().amax(dims, keepdim=True)
    err = ((got - want).abs() / scale.clamp_min(1e-12)).max().item()
    assert err < rtol, f"{what}: row-relative error {err:.2e}"


def test_shares_match_the_dense_reference(arch_model):
    arch, model = arch_model
    tokens = random_tokens(model, 2, 11, seed=2)
    ref = dense_flow_reference(model, tokens)
    result = cw_lens.residual_shares(model, tokens, query_chunk=4)
    for layer, want in enumerate(ref):
        # the reference's own identities: pieces rebuild the HF attention and layer outputs
        assert max(want["errors"].values()) < 1e-4, (arch, layer, want["errors"])
        row_close(result.pairs[:, layer], want["pairs"], 1e-4, f"{arch} L{layer} pairs")
        for piece in PIECES:
            got, exp = getattr(result, piece)[:, layer], want[piece]
            assert torch.allclose(got.double(), exp, atol=2e-5), (arch, layer, piece)
    total = result.total()
    assert torch.allclose(total, torch.ones_like(total), atol=1e-5)
    # the sub-layer shares of the route graph: into m_l, and of m_l in x_{l+1}
    got = collect_mid_shares(model, tokens)
    for layer, want in enumerate(ref):
        assert want["sequential"] == (arch not in ("neox", "gptj")), arch
        if not want["sequential"]:
            assert layer not in got
            continue
        assert want["errors"]["mid"] < 1e-4, (arch, layer, want["errors"])
        mid = got[layer]
        row_close(mid["pairs"], want["mid"]["pairs"], 1e-4, f"{arch} L{layer} pairs into m")
        for piece in ("residual", "attention", "bias"):
            assert torch.allclose(mid[piece].double(), want["mid"][piece], atol=2e-5), piece
        assert torch.allclose(mid["mid_share"].double(), want["mid_share"], atol=2e-5)
        into_m = mid["residual"] + mid["attention"] + mid["bias"]
        assert torch.allclose(into_m, torch.ones(()), atol=1e-5)
        assert torch.allclose(mid["mid_share"] + result.mlp[:, layer], torch.ones(()), atol=1e-5)
    for layer, want in enumerate(ref):
        rows = result.token_matrix(layer)
        assert torch.allclose(rows.double(), dense_token_matrix(want), atol=2e-5)
        assert torch.allclose(rows.sum(-1), torch.ones(()), atol=1e-5)


def collect_mid_shares(model, tokens):
    """Per sequential block: the shares in ``m_l`` and ``share(m_l)`` in ``x_{l+1}``."""
    out: dict = {}

    def keep(ls):
        if not ls.sequential:
            return
        mid = ls.into_mid()
        row = {"pairs": mid.pairs().clone(), "mid_share": ls.mid}
        row.update({p: getattr(mid, p) for p in ("residual", "attention", "bias")})
        old = out.setdefault(ls.layer, {})
        for k, v in row.items():  # query blocks: rows along the query axis (pairs: keys grow)
            if k == "pairs" and k in old:
                v = torch.nn.functional.pad(old[k], (0, v.shape[-1] - old[k].shape[-1]))
                v = torch.cat([v, row[k]], 2)
            elif k in old:
                v = torch.cat([old[k], v], 1)
            old[k] = v

    cw_lens.stream_shares(model, tokens, keep, query_chunk=4)
    return out


def test_padded_batches_match_single_texts(llama):
    texts = ["a longer text with several words", "short"]
    both = cw_lens.residual_shares(llama, texts, query_chunk=3)
    for i, text in enumerate(texts):
        one = cw_lens.residual_shares(llama, text)
        n = one.tokens.shape[1]
        assert torch.allclose(both.pairs[i, :, :, :n, :n], one.pairs[0], atol=1e-5)
        assert torch.allclose(both.mlp[i, :, :n], one.mlp[0], atol=1e-5)
        assert both.residual[i, :, n:].isnan().all()  # padding rows are NaN


def test_rollout_is_the_product_of_the_dense_token_matrices(arch_model):
    arch, model = arch_model
    tokens = random_tokens(model, 2, 9, seed=4)
    ref = dense_flow_reference(model, tokens)
    want = torch.eye(9, dtype=torch.float64).expand(2, 9, 9)
    for layer in ref:
        want = dense_token_matrix(layer) @ want
    result = cw_lens.contribution_rollout(model, tokens, query_chunk=5)
    assert torch.allclose(result.contribution.double(), want, atol=1e-4), arch
    assert torch.allclose(result.contribution.sum(-1), torch.ones(()), atol=1e-4)
    assert torch.allclose(result.attention.sum(-1), torch.ones(()), atol=1e-5)
    # the attention rollout of the same pass equals the stand-alone one
    alone = cw_lens.attention_rollout(model, tokens)
    assert alone.contribution is None and alone.methods == ("attention",)
    assert torch.allclose(alone.matrix, result.attention, atol=1e-6)


def test_rollout_result_views(llama):
    ro = cw_lens.contribution_rollout(llama, ["hello world", "hi"])
    assert ro.contribution[1, 3:].isnan().all() and (ro.contribution[1, :3, 3:] == 0).all()
    top = ro.top(k=3)
    row = ro.contribution[0, -1]
    assert top["contribution"].tolist() == sorted(row.tolist(), reverse=True)[:3]
    df = ro.to_dataframe(batch=1)
    assert len(df) == 3 * 4 // 2  # causal triangle of 3 real tokens
    with pytest.raises(InputError):
        ro.top(query=7, batch=1)


@pytest.mark.parametrize("threshold", [0.0, 0.02, 0.1])
def test_routes_hold_exactly_the_reachable_edges_above_threshold(arch_model, threshold):
    arch, model = arch_model
    tokens = random_tokens(model, 1, 10, seed=6)
    ref = dense_flow_reference(model, tokens)
    g = cw_lens.routes(model, tokens, target=-2, threshold=threshold, query_chunk=4)
    want_edges, want_nodes = dense_route_edges(ref, 8, threshold)
    assert set(g.graph.edges(keys=True)) == want_edges, arch
    assert set(g.graph.nodes) == want_nodes
    # edge shares and factors match the dense pieces; factors multiply back to the share
    for (lj, j), (li, i), key, d in g.graph.edges(keys=True, data=True):
        r = ref[d["layer"]]
        assert (lj, li) == (d["source_layer"], d["target_layer"])
        into = r["mid"] if r["sequential"] and li != d["layer"] + 1 else r
        if key == "mlp":
            want = r["mlp"]
        elif key == "residual":
            want = r["mid_share"] if r["sequential"] and li == d["layer"] + 1 else into["residual"]
        else:
            assert d["share"] == pytest.approx(into["pairs"][0, key, i, j].item(), abs=1e-5)
            assert d["attention"] * d["relative_norm"] * d["cosine"] == pytest.approx(d["share"])
            rel = into["relative_norm"][0, key, i, j].item()
            assert d["relative_norm"] == pytest.approx(rel, rel=1e-4)
            assert d["cosine"] == pytest.approx(into["cosine"][0, key, i, j].item(), abs=1e-4)
            continue
        assert d["share"] == pytest.approx(want[0, i].item(), abs=1e-5), (arch, key)
    # the shares into every node sum to 1 (the bias share a node attribute)
    for node, d in g.graph.nodes(data=True):
        if node[0] == 0:
            continue
        total = sum(d[p] for p in ("residual", "attention", "mlp", "bias"))
        assert total == pytest.approx(1.0, abs=1e-5), (arch, node, d)
        assert d["half"] == (node[0] != int(node[0]))


def test_route_views_and_panel(llama):
    g = cw_lens.routes(llama, "hello <b>world</b> & more", threshold=0.01)
    df = g.to_dataframe()
    assert len(df) == g.graph.number_of_edges()
    assert set(df["kind"]) == {"attention", "residual", "mlp"}
    assert (0.5 in set(df["target_layer"])) and g.mlps()["share"].gt(0.01).all()
    top = g.top(k=3)
    att = df[df["kind"] == "attention"]["share"].sort_values(ascending=False)
    assert top["share"].tolist() == att.head(3).tolist()
    data = g.panel_data()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert len(data["edges"]) == len(df) and data["target"] == g.target
    page = g.to_html()
    assert "<b>world" not in page  # tokens travel as escaped JSON only
    blob = page.split('id="route-data">')[1].split("</script>")[0]
    assert json.loads(blob)["edges"] == data["edges"]


def test_the_documentation_panel_inlines_the_package_routes_js():
    page = (Path(__file__).parents[1] / "docs/flow/routes_ioi.html").read_text(encoding="utf-8")
    js = resources.files("cw_lens.viz").joinpath("routes.js").read_text(encoding="utf-8")
    fix = "run `python docs/flow/make_flow_figures.py --panel` and commit docs/flow/routes_ioi.html"
    assert f"<script>\n{js}\n</script>" in page, f"routes.js changed since the page: {fix}"
    assert rerender_routes_page(page) == page, f"routes.html changed since the page: {fix}"


def test_a_saved_panel_is_rerendered_with_the_current_script_and_its_own_data(llama):
    page = cw_lens.routes(llama, "hello world, routes", threshold=0.01).to_html()
    js = resources.files("cw_lens.viz").joinpath("routes.js").read_text(encoding="utf-8")
    stale = page.replace(js, "/* an older routes.js */")
    assert stale != page and rerender_routes_page(stale) == page
    with pytest.raises(InputError, match="no embedded route data"):
        rerender_routes_page("<html><title>x</title></html>")


def test_routes_validate_their_input(llama):
    with pytest.raises(InputError, match="threshold"):
        cw_lens.routes(llama, "hello", threshold=1.5)
    with pytest.raises(InputError, match="target"):
        cw_lens.routes(llama, "hello", target=40)
    with pytest.raises(InputError, match="one text"):
        cw_lens.routes(llama, ["a", "b"])


@needs_bridge
def test_granite_residual_multiplier_is_refused():
    """hook_attn_out of Granite carries the residual multiplier: not o + b_O -> refused."""
    import transformers as tf

    from cw_lens.models.testing import VOCAB_SIZE, _wrap

    torch.manual_seed(0)
    cfg = tf.GraniteConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, residual_multiplier=0.5,
        attn_implementation="eager", initializer_range=0.2,
    )  # fmt: skip
    model = _wrap(tf.GraniteForCausalLM(cfg), "GraniteForCausalLM", "tiny-granite")
    with pytest.raises(UnsupportedModelError, match=r"attn_out != .*relative error"):
        cw_lens.residual_shares(model, random_tokens(model, 1, 6))


@needs_bridge  # edits the HF layer under the bridge (llama is a bridge wherever one exists)
def test_hooks_that_do_not_add_up_are_refused(llama):
    """Something the hooks do not show: refused, never a wrong number."""
    tokens = random_tokens(llama, 1, 6)
    layer = llama.blocks[1]._original_component

    # the decoder layer adds a constant after its last hook point: resid_post does not add up
    def add_one(mod, args, out):
        return (out[0] + 1.0, *out[1:]) if isinstance(out, tuple) else out + 1.0

    handle = layer.register_forward_hook(add_one)
    try:
        with pytest.raises(UnsupportedModelError, match="resid_post != resid_pre"):
            cw_lens.residual_shares(llama, tokens)
    finally:
        handle.remove()
    # z edited after the pattern: the pattern and values are not what z is made of
    with llama.hooks(fwd_hooks=[("blocks.0.attn.hook_z", lambda t, hook: 0.5 * t)]):
        with pytest.raises(UnsupportedModelError, match="pattern @ v"):
            cw_lens.residual_shares(llama, tokens)


def test_unknown_post_norm_is_refused(llama):
    from cw_lens.models.blocks import norm_spec

    class FancyNorm(torch.nn.Module):  # no RMS/LayerNorm formula we know
        weight = torch.nn.Parameter(torch.ones(4))
        eps = 1e-6

    with pytest.raises(UnsupportedModelError, match="post-attention norm of layer 3"):
        norm_spec(llama, FancyNorm(), 3)
    gemma_like = type("Gemma3RMSNorm", (FancyNorm,), {})()
    assert torch.equal(norm_spec(llama, gemma_like, 0).gain, torch.full((4,), 2.0))  # 1 + w


def test_deletion_equals_an_independent_key_mask(llama):
    """The deleted run's log-prob equals a hand-written run that zeroes the keys' attention."""
    texts = ["the quick brown fox jumps", "a b c d e f g"]
    d = cw_lens.rollout_deletion(llama, texts, ks=(1, 3), n_random=2, batch_size=None)
    ro = cw_lens.contribution_rollout(llama, texts)
    df = d.to_dataframe()
    assert set(df["method"]) == {"contribution", "attention", "random"}
    assert len(df) == 2 * 2 * (2 + 2)  # items x ks x (2 rankings + 2 draws)
    for item, text in enumerate(texts):
        batch = cw_lens.data.inputs.prepare_inputs(llama, text)
        n = batch.tokens.shape[1]
        target = n - 2
        row = ro.contribution[item, target, :target]
        chosen = torch.argsort(row, descending=True, stable=True)[:3].tolist()

        def zero(pattern, hook, chosen=chosen):
            pattern = pattern.clone()
            pattern[..., chosen] = 0.0
            return pattern

        hooks = [(f"blocks.{layer}.attn.hook_pattern", zero) for layer in range(2)]
        with torch.no_grad():
            clean = llama(batch.tokens).log_softmax(-1)[0, target, batch.tokens[0, -1]]
            with llama.hooks(fwd_hooks=hooks):
                masked = llama(batch.tokens).log_softmax(-1)[0, target, batch.tokens[0, -1]]
        rec = df[(df["item"] == item) & (df["method"] == "contribution") & (df["k"] == 3)]
        assert rec["clean_logprob"].item() == pytest.approx(clean.item(), abs=1e-4)
        assert rec["drop"].item() == pytest.approx((clean - masked).item(), abs=1e-4)
    summary = d.summary()
    assert set(summary["method"]) == {"contribution", "attention", "random"}
    assert d.aopc().index.tolist() == sorted(d.aopc().index.tolist())


def test_deletion_skips_items_with_too_few_candidates(llama):
    d = cw_lens.rollout_deletion(llama, ["abcd"], ks=(2, 8), n_random=1)
    df = d.to_dataframe()
    assert df[df["k"] == 8]["drop"].isna().all()  # 3 candidates before the target
    assert df[df["k"] == 2]["drop"].notna().all()


@pytest.mark.browser
def test_browser_panel_shows_an_edge_with_its_factors(llama, browser, tmp_path):
    import html
    import re

    g = cw_lens.routes(llama, "hello world, routes", threshold=0.01)
    edges = g.panel_data()["edges"]
    i = next(n for n, e in enumerate(edges) if e["kind"] == "attention")
    path = tmp_path / "routes.html"
    path.write_text(g.to_html(), encoding="utf-8")
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{path.as_uri()}#edge={i}")
    page.wait_for_selector(f'#tip[data-edge="{i}"]', timeout=20_000)
    dom = page.content()
    assert not errors
    tip = re.search(r'<div id="tip"[^>]*data-edge="(\d+)"[^>]*>(.*?)</div>', dom, re.S)
    assert tip is not None and int(tip.group(1)) == i
    text = html.unescape(tip.group(2))
    e = edges[i]
    assert f"layer {e['layer']}  head {e['head']}" in text
    shown = dict(re.findall(r"(share|attention|relative norm|cosine) (-?[\d.e+-]+)", text))
    for label, key in (("share", "share"), ("attention", "attention"),
                       ("relative norm", "relative_norm"), ("cosine", "cosine")):  # fmt: skip
        assert float(shown[label]) == pytest.approx(e[key], rel=1e-3)
    assert dom.count('class="edge"') == len(edges)
    page.close()


def _hooked_transformer():
    try:
        from transformer_lens import HookedTransformer
    except ImportError:
        return None
    return HookedTransformer


@pytest.mark.skipif(
    _hooked_transformer() is None,
    reason="HookedTransformer exists in TransformerLens 2.x/3.x only (the compat venvs)",
)
@pytest.mark.parametrize("post_norm", [False, True])
def test_hooked_transformer_shares_match_a_dense_reference(post_norm):
    """TL 2.x/3.x HookedTransformer, pre- and post-norm (Gemma-2-style) blocks, against pieces
    built from its own modules (the post-norm linearised with the module itself)."""
    from transformer_lens import HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=2, d_model=32, d_head=8, n_heads=4, n_key_value_heads=2, d_mlp=64, n_ctx=16,
        d_vocab=50, act_fn="gelu", normalization_type="RMS", positional_embedding_type="rotary",
        use_normalization_before_and_after=post_norm,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _hooked_transformer()(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    tokens = torch.randint(0, 50, (2, 9))
    result = cw_lens.residual_shares(model, tokens)
    _, cache = model.run_with_cache(tokens)
    for layer in range(2):
        c = {
            k: cache[f"blocks.{layer}.{k}"].double() for k in ("hook_resid_pre", "hook_resid_post")
        }
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        v = cache[f"blocks.{layer}.attn.hook_v"].double().repeat_interleave(2, dim=2)
        W_O = model.blocks[layer].attn.W_O.detach().double()
        pv = torch.einsum("bkhd,hdm->bhkm", v, W_O)
        pieces = pattern[..., None] * pv[:, :, None]  # [batch, head, query, key, d_model]
        if post_norm:
            norm = model.blocks[layer].ln1_post
            a = pieces.sum((1, 3)) + model.blocks[layer].attn.b_O.detach().double()
            eps = norm.eps
            pieces = (
                norm(pieces.float()).double()
                * (pieces.pow(2).mean(-1, keepdim=True) + eps).sqrt()
                / (a.pow(2).mean(-1, keepdim=True) + eps).sqrt()[:, None, :, None]
            )
        y = c["hook_resid_post"]
        want = (pieces * y[:, None, :, None]).sum(-1) / y.pow(2).sum(-1)[:, None, :, None]
        assert torch.allclose(result.pairs[:, layer].double(), want, atol=1e-5)
        res = (c["hook_resid_pre"] * y).sum(-1) / y.pow(2).sum(-1)
        assert torch.allclose(result.residual[:, layer].double(), res, atol=1e-5)
    assert torch.allclose(result.total(), torch.ones(()), atol=1e-5)


@needs_bridge
def test_attention_rollout_rows_sum_to_one_with_learned_sink_logits():
    """GPT-OSS: attention rows sum to less than 1 (learned sink logits take softmax mass);
    attention rollout re-normalises each step's rows (methods § Contribution flow), computed here
    independently
    from the float64 HF twin's attention probabilities."""
    from arch_checks import built

    b = built("GPT-OSS")
    tokens = random_tokens(b.bridge, 2, 12, seed=5)
    with torch.no_grad():
        attentions = b.hf(tokens, output_attentions=True).attentions
    assert attentions[0].sum(-1).min() < 0.95  # the premise of the test
    n = tokens.shape[1]
    eye = torch.eye(n, dtype=torch.float64)
    want = eye.expand(2, n, n)
    for alpha in attentions:
        step = 0.5 * alpha.mean(1) + 0.5 * eye
        want = (step / step.sum(-1, keepdim=True)) @ want
    got = cw_lens.attention_rollout(b.bridge, tokens).attention
    assert torch.allclose(got.sum(-1).double(), torch.ones(2, n, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(got.double(), want, atol=1e-6)
    both = cw_lens.contribution_rollout(b.bridge, tokens)
    assert torch.allclose(both.attention, got, atol=1e-6)
    assert torch.allclose(both.contribution.sum(-1), torch.ones(()), atol=1e-4)


def test_a_kept_block_stays_valid_after_the_stream(llama):
    """A LayerSharesResult the consumer keeps owns its pair shares by default: read after the
    stream, each equals the block read inside the call (which the next block's buffer would
    have overwritten when the buffers were reused)."""
    tokens = random_tokens(llama, 2, 10)
    inside, kept = [], []

    def consumer(block):
        inside.append(block.pairs().clone())
        kept.append(block)

    cw_lens.stream_shares(llama, tokens, consumer, query_chunk=4)
    read_after = [block.pairs() for block in kept]  # every read before any comparison
    assert len(kept) > 2 and not any(block.is_view for block in kept)
    for got, want in zip(read_after, inside, strict=True):
        assert torch.equal(got, want)


def test_a_view_refuses_to_be_read_late_and_its_copy_stays_valid(llama):
    tokens = random_tokens(llama, 2, 10)
    inside, views, copies = [], [], []

    def consumer(block):
        inside.append(block.pairs().clone())
        views.append(block)
        copies.append(block.detach_copy())

    cw_lens.stream_shares(llama, tokens, consumer, query_chunk=4, reuse_buffers=True)
    assert all(block.is_view for block in views)
    with pytest.raises(InputError, match=r"view.*detach_copy\(\)"):
        views[0].pairs()
    read_after = [copy.pairs() for copy in copies]
    for got, want in zip(read_after, inside, strict=True):
        assert torch.equal(got, want)
