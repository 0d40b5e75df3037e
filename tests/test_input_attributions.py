"""The input-level attributions against independent computations on the Hugging Face model.

- Input x gradient and integrated gradients (`cw_lens.models.input_gradients`, captum on
  `hook_embed`) against autograd through the HF model's `inputs_embeds` in float64, the
  integral taken with the Gauss-Legendre nodes from numpy: within `RTOL` (1e-5) of the largest
  score, on tiny models of four architectures. And against inseq 0.7 itself (a test-only dependency,
  installed without its dependencies by `make install`), on GPT-2 with inseq's own baseline.
- Value zeroing (`cw_lens.models.value_zeroing`) against inseq's algorithm rebuilt on the HF
  modules: the value projection's output at token `j` zeroed in every layer, every decoder
  layer's output replaced by the clean one, `1 - cos` of the decoder layers' outputs,
  row-normalised. (inseq 0.7.1's own value zeroing cannot run on transformers 5: it finds the
  value tensor by reading the attention module's source, and its patching hook expects the
  decoder layer to return a tuple.)
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch
from architectures import BY_NAME, build
from hf_reference import split_values

import cw_lens
from cw_lens.data.inputs import prepare_inputs
from cw_lens.data.scoring import answer_logprobs
from cw_lens.models.input_gradients import embedding_attributions
from cw_lens.models.testing import byte_tokenizer, random_tokens
from cw_lens.models.value_zeroing import value_zeroing

ARCHS = ["Llama", "GPT-2", "Gemma 2", "Qwen2"]
# of the largest score: the bridge's RMSNorms compute in float32 (Llama and Qwen2 reach 1.6e-6)
RTOL = 1e-5
N_STEPS = 8


def _built(name, dtype=torch.float64):
    got = build(replace(BY_NAME[name], dtype=dtype), seed=1)
    if got.error is not None:
        pytest.skip(f"{name}: this TransformerLens cannot bridge it ({got.error})")
    return got


def _target(batch, spans):
    def target(logits, rows):
        return answer_logprobs(
            logits, batch.tokens.to(logits.device)[rows], [spans[r] for r in rows.tolist()]
        )

    return target


def _hf_target(hf, tokens, spans, embeds):
    logits = hf(inputs_embeds=embeds, use_cache=False).logits.double()
    return torch.stack(
        [
            sum(torch.log_softmax(logits[r, t - 1], -1)[tokens[r, t]] for t in range(start, end))
            for r, (start, end) in enumerate(spans)
        ]
    )


def _hf_gradient(hf, tokens, spans, embeds):
    e = embeds.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(_hf_target(hf, tokens, spans, e).sum(), e)
    return grad


@pytest.mark.parametrize("name", ARCHS)
def test_gradient_attributions_match_autograd_through_the_hf_model(name):
    got = _built(name)
    hf = got.hf.double()
    tokens = random_tokens(got.bridge, 2, 9, seed=3)
    spans = [(7, 9), (8, 9)]  # a two-token answer and a one-token answer
    batch = prepare_inputs(got.bridge, tokens, prepend_bos=False)
    embeds = hf.get_input_embeddings()(tokens).double()

    ixg = embedding_attributions(
        got.bridge, batch, _target(batch, spans), method="input_x_gradient"
    )
    want = (embeds * _hf_gradient(hf, tokens, spans, embeds)).sum(-1)
    err = ((ixg.scores.double() - want).abs().max() / want.abs().max()).item()
    assert err < RTOL, f"{name} input x gradient: {err:.2e}"

    ig = embedding_attributions(
        got.bridge, batch, _target(batch, spans), method="integrated_gradients", n_steps=N_STEPS
    )
    nodes, weights = np.polynomial.legendre.leggauss(N_STEPS)
    total = torch.zeros_like(embeds)
    for x, w in zip(nodes, weights, strict=True):
        alpha = 0.5 * (x + 1.0)
        total += 0.5 * w * _hf_gradient(hf, tokens, spans, alpha * embeds)
    want = (embeds * total).sum(-1)
    err = ((ig.scores.double() - want).abs().max() / want.abs().max()).item()
    assert err < RTOL, f"{name} integrated gradients: {err:.2e}"
    # completeness as captum measures it, against the HF model's own target values
    with torch.no_grad():
        change = _hf_target(hf, tokens, spans, embeds) - _hf_target(
            hf, tokens, spans, torch.zeros_like(embeds)
        )
    deviation = (ig.scores.double().sum(-1) - change).abs()
    assert torch.allclose(deviation, ig.completeness_error.double(), rtol=1e-4, atol=1e-8)


@pytest.mark.skipif(
    importlib.util.find_spec("inseq") is None,
    reason="inseq is installed by `make install` (without its dependencies); not in this venv",
)
def test_gradient_attributions_match_inseq():
    import inseq

    got = _built("GPT-2", dtype=torch.float32)
    hf, tok = got.hf.float(), byte_tokenizer()
    prompt, full = "abcdefg", "abcdefgh"
    tokens = torch.tensor([tok(full)["input_ids"]])
    n = tokens.shape[1]
    batch = prepare_inputs(got.bridge, tokens, prepend_bos=False)
    target = _target(batch, [(n - 1, n)])
    ours = {
        "input_x_gradient": embedding_attributions(
            got.bridge, batch, target, method="input_x_gradient"
        ),
        # inseq's baseline: its tokenizer's UNK token at every position (PAD when none)
        "integrated_gradients": embedding_attributions(
            got.bridge,
            batch,
            target,
            method="integrated_gradients",
            n_steps=32,
            baseline_token=tok.pad_token_id,
        ),
    }
    for method, mine in ours.items():
        model = inseq.load_model(hf, method, tokenizer=tok)
        kwargs = {"n_steps": 32} if method == "integrated_gradients" else {}
        out = model.attribute(
            prompt,
            generated_texts=full,
            attributed_fn="probability",
            attributed_fn_args={"logprob": True},
            show_progress=False,
            skip_special_tokens=False,
            **kwargs,
        )
        theirs = out.sequence_attributions[0].target_attributions[: n - 1, 0].sum(-1)
        have = mine.scores[0, : n - 1]
        err = ((have - theirs).abs().max() / theirs.abs().max()).item()
        assert err < 1e-5, f"{method}: {err:.2e} from inseq"


def _hf_value_zeroing(arch, hf, tokens):
    """inseq's value zeroing on the HF modules, float64, every layer: `[batch, layer, q, k]`."""
    blocks = [hf.get_submodule(arch.attn.format(i).rsplit(".", 1)[0]) for i in range(99)
              if _has(hf, arch.attn.format(i))]  # fmt: skip
    values = [hf.get_submodule(f"{arch.attn.format(i)}.{arch.values}") for i in range(len(blocks))]
    d_head = hf.config.hidden_size // hf.config.num_attention_heads
    d_head = getattr(hf.config, "head_dim", None) or d_head
    clean: dict[int, torch.Tensor] = {}
    got: dict[int, torch.Tensor] = {}

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def keep(i):
        return lambda m, a, out: clean.__setitem__(i, first(out).detach().clone())

    handles = [b.register_forward_hook(keep(i)) for i, b in enumerate(blocks)]
    with torch.no_grad():
        hf(tokens, use_cache=False)
    for h in handles:
        h.remove()
    b, n = tokens.shape
    scores = torch.zeros(b, len(blocks), n, n, dtype=torch.float64)
    for j in range(n):

        def zero(m, a, out, j=j):
            out = out.clone()
            v = split_values(arch, hf, out, d_head)  # a view of the value columns
            width = v.shape[-2] * v.shape[-1]
            out[:, j, out.shape[-1] - width :] = 0.0  # "heads" and "qkv_concat": v comes last
            return out

        def patch(i):
            def fn(m, a, out):
                got[i] = first(out).detach().clone()
                return (clean[i], *out[1:]) if isinstance(out, tuple) else clean[i]

            return fn

        handles = [v.register_forward_hook(zero) for v in values]
        handles += [blk.register_forward_hook(patch(i)) for i, blk in enumerate(blocks)]
        with torch.no_grad():
            hf(tokens, use_cache=False)
        for h in handles:
            h.remove()
        for i in range(len(blocks)):
            cos = torch.nn.functional.cosine_similarity(got[i], clean[i], dim=-1)
            scores[:, i, :, j] = 1.0 - cos
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.clamp_min(0.0) * causal
    return scores / scores.sum(-1, keepdim=True)


def _has(hf, path):
    try:
        hf.get_submodule(path)
        return True
    except AttributeError:
        return False


@pytest.mark.parametrize("name", ["Llama", "GPT-2", "Gemma 2"])
def test_value_zeroing_matches_the_hf_modules(name):
    got = _built(name)
    assert got.arch.layout in ("heads", "qkv_concat")
    tokens = random_tokens(got.bridge, 2, 7, seed=4)
    batch = prepare_inputs(got.bridge, tokens, prepend_bos=False)
    have = value_zeroing(got.bridge, batch, rows_per_pass=5).double()
    want = _hf_value_zeroing(got.arch, got.hf.double(), tokens)
    err = (have - want).abs().max().item()
    assert err < 1e-6, f"{name}: {err:.2e}"
    assert torch.allclose(have.sum(-1), torch.ones_like(have.sum(-1)), atol=1e-6)


def test_value_zeroing_is_the_same_in_any_rows_per_pass():
    model = cw_lens.load_model("testing:tiny-llama")
    batch = prepare_inputs(model, ["The cat sat on the mat.", "Hi"])
    one = value_zeroing(model, batch, rows_per_pass=1)
    many = value_zeroing(model, batch, rows_per_pass=64)
    assert (one - many).abs().max() < 1e-5
    assert (one[1, :, 3:] == 0).all()  # padding rows
