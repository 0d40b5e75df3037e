"""Tiny models of six architectures and a dense float64 reference of the residual shares.

The reference reads the residual stream and every piece from the Hugging Face modules
themselves (torch forward hooks on the decoder layers, the attention modules, the MLPs and the
post-norms), takes ``W_O``/``b_O`` from the HF output projection, and materialises every
``A_i(alpha[i,j] pv_j^h)`` as a ``d_model`` vector. Only the attention pattern and the values
come from TransformerLens hooks; the reference checks that they rebuild the HF attention
output. The post-norm linearisation uses the HF norm module itself:
``A_i(p) = norm(p) * rms(p) / rms(a_i)`` (RMSNorm with its own gain convention).
"""

from __future__ import annotations

import networkx as nx
import torch

from cw_lens.models.testing import BYTE_VOCAB, VOCAB_SIZE, _wrap

SPECIAL = {
    "bos_token_id": BYTE_VOCAB,
    "eos_token_id": BYTE_VOCAB + 1,
    "pad_token_id": BYTE_VOCAB + 2,
}


def _orig(module):
    return getattr(module, "original_component", None) or module


def tiny_model(arch: str, seed: int = 0, n_layers: int = 2):
    """A random tiny bridge of ``arch`` (llama, gpt2, neox, gptj, gemma2, olmo2)."""
    import transformers as tf

    from cw_lens.models.testing import tiny_gpt2, tiny_llama

    if arch == "llama":
        return tiny_llama(seed=seed, n_layers=n_layers, api="bridge")
    if arch == "gpt2":
        return tiny_gpt2(seed=seed, n_layers=n_layers, api="bridge")
    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB_SIZE, "attn_implementation": "eager", **SPECIAL}
    common["initializer_range"] = 0.2
    if arch == "neox":
        cfg = tf.GPTNeoXConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
            num_attention_heads=4, use_parallel_residual=True, **common,
        )  # fmt: skip
        hf, name = tf.GPTNeoXForCausalLM(cfg), "GPTNeoXForCausalLM"
    elif arch == "gptj":
        cfg = tf.GPTJConfig(n_embd=64, n_layer=n_layers, n_head=4, rotary_dim=8, **common)
        hf, name = tf.GPTJForCausalLM(cfg), "GPTJForCausalLM"
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, **common,
        )  # fmt: skip
        hf, name = tf.Gemma2ForCausalLM(cfg), "Gemma2ForCausalLM"
    elif arch == "olmo2":
        cfg = tf.Olmo2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
            num_attention_heads=4, num_key_value_heads=2, **common,
        )  # fmt: skip
        hf, name = tf.Olmo2ForCausalLM(cfg), "Olmo2ForCausalLM"
    else:
        raise ValueError(arch)
    with torch.no_grad():  # non-trivial norm gains and biases, so they take part in the tests
        for pname, p in hf.named_parameters():
            if "norm" in pname or "ln" in pname:
                p.add_(torch.randn_like(p) * 0.3)
            elif pname.endswith(".bias"):
                p.normal_(0.0, 0.2)
    return _wrap(hf, name, f"tiny-{arch}")


# per architecture: decoder layers, attention module, output projection, MLP piece, post-attn
# norm, and the module whose input is m_l (the stream the MLP reads; None: parallel block)
LAYOUT = {
    "LlamaForCausalLM": (
        "model.layers", "self_attn", "self_attn.o_proj", "mlp", None, "post_attention_layernorm",
    ),
    "GPT2LMHeadModel": ("transformer.h", "attn", "attn.c_proj", "mlp", None, "ln_2"),
    "GPTNeoXForCausalLM": ("gpt_neox.layers", "attention", "attention.dense", "mlp", None, None),
    "GPTJForCausalLM": ("transformer.h", "attn", "attn.out_proj", "mlp", None, None),
    "Gemma2ForCausalLM": (
        "model.layers", "self_attn", "self_attn.o_proj", "post_feedforward_layernorm",
        "post_attention_layernorm", "pre_feedforward_layernorm",
    ),
    "Olmo2ForCausalLM": (
        "model.layers", "self_attn", "self_attn.o_proj", "post_feedforward_layernorm",
        "post_attention_layernorm", "mlp",
    ),
}  # fmt: skip


def _get(root, path, unwrap=True):
    """The submodule at ``path``; ``unwrap=False`` keeps the module the HF layer really calls
    (the bridge reimplements attention around the HF weights)."""
    for part in path.split("."):
        root = getattr(_orig(root), part)
    return _orig(root) if unwrap else root


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _output_weights(proj, n_heads):
    """``W_O`` [head, d_head, d_model] and ``b_O`` from an HF Linear or Conv1D (float64)."""
    w = proj.weight.detach().double()
    if type(proj).__name__ == "Conv1D":  # GPT-2: weight [in, out]
        w = w.T
    d_model, width = w.shape
    W_O = w.T.reshape(n_heads, width // n_heads, d_model)
    b = getattr(proj, "bias", None)
    return W_O, None if b is None else b.detach().double()


def dense_flow_reference(model, tokens, attention_mask=None):
    """Per layer: dense float64 shares of every piece (and the pieces themselves).

    Returns a list (one dict per layer) with ``pairs`` [batch, head, query, key], ``residual``,
    ``attention``, ``bias``, ``mlp`` [batch, query], ``relative_norm`` and ``cosine`` of the
    pairs (all shares in ``x_{l+1}``), the stream ``y``, ``sequential`` and the max
    reconstruction errors the reference itself found. On sequential blocks also ``mid`` (the
    same shares in ``m_l``, read as the input of the module the MLP reads it with: pairs,
    residual, bias, attention, relative_norm, cosine) and ``mid_share`` (``share(m_l)`` in
    ``x_{l+1}``).
    """
    hf = model.original_model
    arch = type(hf).__name__
    layers_path, attn_path, proj_path, mlp_path, norm_path, mid_path = LAYOUT[arch]
    layer_mods = _get(hf, layers_path)
    got: dict = {}
    handles = []

    def grab(name, kind="out"):
        def hook(mod, args, kwargs, out):
            if kind == "in":
                got[name] = (args[0] if args else kwargs["hidden_states"]).detach().double()
            else:
                got[name] = _first(out).detach().double()

        return hook

    n_layers = model.cfg.n_layers
    for layer in range(n_layers):
        dec = _orig(layer_mods[layer])
        handles.append(dec.register_forward_hook(grab(("x_in", layer), "in"), with_kwargs=True))
        handles.append(dec.register_forward_hook(grab(("x_out", layer)), with_kwargs=True))
        for key, path in (("attn", attn_path), ("mlp", mlp_path), ("post", norm_path)):
            if path is not None:
                mod = _get(dec, path, unwrap=False)
                handles.append(mod.register_forward_hook(grab((key, layer)), with_kwargs=True))
        if mid_path is not None:
            mod = _get(dec, mid_path, unwrap=False)
            handles.append(mod.register_forward_hook(grab(("m", layer), "in"), with_kwargs=True))
    names = [f"blocks.{i}.attn.hook_{k}" for i in range(n_layers) for k in ("pattern", "v")]
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(
                tokens, attention_mask=attention_mask, names_filter=names
            )
    finally:
        for h in handles:
            h.remove()
    out = []
    for layer in range(n_layers):
        dec = _orig(layer_mods[layer])
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        values = cache[f"blocks.{layer}.attn.hook_v"].double()
        n_heads = pattern.shape[1]
        W_O, b_O = _output_weights(_get(dec, proj_path), n_heads)
        group = n_heads // values.shape[2]
        pv = torch.stack([values[:, :, h // group] @ W_O[h] for h in range(n_heads)], 1)
        pieces = pattern[..., None] * pv[:, :, None]  # [batch, head, query, key, d_model]
        a = pieces.sum((1, 3)) + (0 if b_O is None else b_O)
        attn_err = (a - got[("attn", layer)]).abs().max().item()
        bias = torch.zeros_like(a) + (0 if b_O is None else b_O)
        if norm_path is not None:
            norm = _get(dec, norm_path)
            eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))

            def rms(t, eps=eps):
                return (t.pow(2).mean(-1, keepdim=True) + eps).sqrt()

            a_scale = rms(a)  # [batch, query, 1]
            pieces = norm(pieces.float()).double() * rms(pieces) / a_scale[:, None, :, None, :]
            bias = norm(bias.float()).double() * rms(bias) / a_scale
            attn_piece = got[("post", layer)]
        else:
            attn_piece = got[("attn", layer)]
        piece_err = (pieces.sum((1, 3)) + bias - attn_piece).abs().max().item()
        x_in, y, mlp = got[("x_in", layer)], got[("x_out", layer)], got[("mlp", layer)]
        block_err = (x_in + attn_piece + mlp - y).abs().max().item()
        entry = _shares_into(pieces, pattern, {"residual": x_in, "bias": bias, "mlp": mlp}, y)
        entry["y"] = y
        # the attention sub-layer's parts and whole as they enter the residual (ALTI's)
        entry["pieces"], entry["x_in"], entry["attn_piece"] = pieces, x_in, attn_piece
        entry["errors"] = {"attn": attn_err, "pieces": piece_err, "block": block_err}
        entry["sequential"] = mid_path is not None
        if mid_path is not None:  # shares into m_l (the MLP's input, read from the HF module)
            m = got[("m", layer)]
            entry["errors"]["mid"] = (x_in + attn_piece - m).abs().max().item()
            mid = _shares_into(pieces, pattern, {"residual": x_in, "bias": bias}, m)
            entry["mid"] = mid
            entry["mid_share"] = (m * y).sum(-1) / y.pow(2).sum(-1)  # share(m_l) in x_{l+1}
        out.append(entry)
    return out


def _shares_into(pieces, pattern, plain, y):
    """Dense shares of every pair piece and of the ``plain`` pieces in the stream ``y``, with
    the pairs' relative norm and cosine."""
    sq = y.pow(2).sum(-1)
    pairs = (pieces * y[:, None, :, None, :]).sum(-1) / sq[:, None, :, None]
    rel = pieces.norm(dim=-1) / pattern.clamp_min(1e-300) / sq.sqrt()[:, None, :, None]
    cos = torch.nn.functional.cosine_similarity(pieces, y[:, None, :, None, :], dim=-1)
    out = {name: (p * y).sum(-1) / sq for name, p in plain.items()}
    return {**out, "pairs": pairs, "attention": pairs.sum((1, 3)), "relative_norm": rel,
            "cosine": cos}  # fmt: skip


def dense_token_matrix(ref_layer):
    """``T_l`` from the dense reference (float64)."""
    t = ref_layer["pairs"].sum(1).clone()
    diag = ref_layer["residual"] + ref_layer["bias"] + ref_layer["mlp"]
    n = t.shape[-1]
    t[:, torch.arange(n), torch.arange(n)] += diag
    return t


def dense_route_edges(ref, target, threshold, batch=0):
    """Route edges of methods § Contribution flow's sub-layer graph from the dense reference,
    traced with networkx
    (independent of fg): ``(l, j) -> (l+0.5, i)`` (heads, shares into ``m_l``) and ``(l, i) ->
    (l+0.5, i)`` (residual), ``(l+0.5, i) -> (l+1, i)`` (residual = share of ``m_l``, MLP) on
    sequential blocks; ``(l, j) -> (l+1, i)`` (heads), residual and MLP from ``(l, i)`` on
    parallel ones."""
    n_layers = len(ref)
    g = nx.MultiDiGraph()
    g.add_node((n_layers, target))

    def add(shares, src, dst, key):
        for i in (shares[batch] > threshold).nonzero().flatten().tolist():
            g.add_edge((src, i), (dst, i), key=key)

    for layer, r in enumerate(ref):
        into = r["mid"] if r["sequential"] else r
        up = layer + 0.5 if r["sequential"] else layer + 1
        for h, i, j in (into["pairs"][batch] > threshold).nonzero().tolist():
            g.add_edge((layer, j), (up, i), key=h)
        if r["sequential"]:
            add(into["residual"], layer, up, "residual")
            add(r["mid_share"], up, layer + 1, "residual")
            add(r["mlp"], up, layer + 1, "mlp")
        else:
            add(r["residual"], layer, layer + 1, "residual")
            add(r["mlp"], layer, layer + 1, "mlp")
    keep = nx.ancestors(g, (n_layers, target)) | {(n_layers, target)}
    return {(u, v, k) for u, v, k in g.edges(keys=True) if v in keep}, keep
