r"""Gradient attributions of a target to each input token's embedding: input × gradient and
integrated gradients, computed by captum on the model's token embeddings.

For a target `f` (a scalar per row, e.g. the answer's log-probability) and the token
embeddings `e_j` (the output of `hook_embed`, before any positional embedding is added):

- **input × gradient** (Shrikumar et al. 2016; Denil et al. 2014): `s_j = <e_j, df/de_j>`;
- **integrated gradients** (Sundararajan et al. 2017, "Axiomatic Attribution for Deep
  Networks"): `s_j = <e_j - b_j, integral_0^1 df/de_j(b + t (e - b)) dt>` with the baseline
  `b = 0`, the integral taken by captum's Gauss-Legendre rule (`n_steps`, 32 by default).
  The scores sum to `f(e) - f(b)` (completeness); captum's deviation from it is returned as
  the `completeness_error` of each row.

Both are invariant to a fixed rescaling of the embeddings (Gemma multiplies them by
`sqrt(d_model)`), so whichever side of such a scale `hook_embed` sits on gives the same scores.
The embedding is replaced through `hook_embed`; the replacement is checked to reach the model
(a forward with the baseline must change the target) before any score is returned.

Example:

    import cw_lens
    from cw_lens.data.inputs import answer_spans
    from cw_lens.data.scoring import answer_logprobs
    from cw_lens.models.input_gradients import embedding_attributions

    model = cw_lens.load_model("testing:tiny-llama")
    items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
    batch, spans = answer_spans(model, list(items))
    scores = embedding_attributions(
        model, batch, lambda logits, rows: answer_logprobs(logits, batch.tokens[rows],
                                                           [spans[r] for r in rows.tolist()]),
        method="integrated_gradients",
    )
    scores.scores.shape  # [batch, pos]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from cw_lens.core.errors import InputError, UnsupportedModelError
from cw_lens.models.access import model_access
from cw_lens.models.batch import TokenBatch

GRADIENT_METHODS = ("input_x_gradient", "integrated_gradients")
EMBED_HOOK = "hook_embed"
DEFAULT_STEPS = 32

# `target(logits, rows)`: the per-row scalar attributed, for the batch rows `rows` (int64) that
# the logits `[len(rows), pos, vocab]` belong to (integrated gradients runs many copies of a row)
Target = Callable[[Tensor, Tensor], Tensor]


@dataclass
class EmbeddingAttributions:
    """Per token, the target's attribution to its embedding.

    Attributes:
        method: `input_x_gradient` or `integrated_gradients`.
        scores: `s_j` `[batch, pos]`, the attribution summed over the embedding (signed;
            0 at padding).
        target: The target of each row on the clean input `[batch]`.
        completeness_error: Integrated gradients: `|sum_j s_j - (f(e) - f(b))|` per row,
            captum's deviation from completeness (`None` for input x gradient).
    """

    method: str
    scores: Float[Tensor, "batch pos"]
    target: Float[Tensor, " batch"]
    completeness_error: Float[Tensor, " batch"] | None


def embedding_attributions(
    model: Any,
    batch: TokenBatch,
    target: Target,
    *,
    method: str = "integrated_gradients",
    n_steps: int = DEFAULT_STEPS,
    internal_batch_size: int | None = None,
    baseline_token: int | None = None,
) -> EmbeddingAttributions:
    """Input x gradient or integrated gradients of `target` on each token embedding (captum).

    Args:
        model: A TransformerLens model.
        batch: Right-padded documents.
        target: `target(logits, rows)`: a scalar per row of the logits, differentiable; `rows`
            are the batch rows (int64) the logits belong to.
        method: `input_x_gradient` (one forward and one backward pass) or
            `integrated_gradients` (`n_steps` of each, from the zero baseline).
        n_steps: Integration points of integrated gradients.
        internal_batch_size: Rows per forward pass of integrated gradients (default: the
            batch's size, so a pass is never larger than the batch).
        baseline_token: Integrated gradients' baseline: `None` (default) is the zero
            embedding; a token id puts that token's embedding at every position (inseq's
            default is its tokenizer's UNK token, or PAD when there is none).

    Returns:
        An `EmbeddingAttributions`.

    Raises:
        InputError: On an unknown method or a bad `n_steps`.
        UnsupportedModelError: When the model has no `hook_embed`, or replacing its output
            does not change the model's output (the scores would be gradients of nothing).
    """
    from captum.attr import InputXGradient, IntegratedGradients

    if method not in GRADIENT_METHODS:
        raise InputError(f"method must be one of {GRADIENT_METHODS}, got {method!r}.")
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 2:
        raise InputError(f"n_steps must be an integer >= 2, got {n_steps!r}.")
    access = model_access(model)
    if not access.has_hook(EMBED_HOOK):
        raise UnsupportedModelError(
            f"{access.architecture}: the model has no {EMBED_HOOK}, so the token embeddings "
            "cannot be replaced; gradient attributions to input tokens cannot run."
        )
    device = access.device
    tokens = batch.tokens.to(device)
    rows = torch.arange(tokens.shape[0], device=device)
    captured: dict[str, Tensor] = {}

    def keep(t: Tensor, hook: Any) -> None:
        captured["embed"] = t.detach()

    with torch.no_grad(), access.hooks([(EMBED_HOOK, keep)]):
        clean = target(access.forward(tokens), rows).float()
    # float32 at least: half-precision embeddings would make the integral coarse
    compute = torch.promote_types(captured["embed"].dtype, torch.float32)
    embed = captured["embed"].to(compute)
    baseline = torch.zeros_like(embed)
    if baseline_token is not None:
        with torch.no_grad(), access.hooks([(EMBED_HOOK, keep)]):
            access.forward(torch.full_like(tokens, int(baseline_token)))
        baseline = captured["embed"].to(compute)

    def forward(embeds: Tensor, toks: Tensor, which: Tensor) -> Tensor:
        def replace(t: Tensor, hook: Any) -> Tensor:
            return embeds.to(t.dtype)

        with access.hooks([(EMBED_HOOK, replace)]):
            return target(access.forward(toks), which).float()

    with torch.no_grad():
        at_baseline = forward(baseline, tokens, rows)
    if bool((at_baseline == clean).all()):
        raise UnsupportedModelError(
            f"{access.architecture}: replacing the output of {EMBED_HOOK} does not change the "
            "model's output, so the model does not read its embeddings there; gradient "
            "attributions to input tokens cannot run."
        )
    mask = batch.mask.to(device)[..., None]
    inputs = embed.clone().requires_grad_(True)
    args = (tokens, rows)
    if method == "input_x_gradient":
        attr = InputXGradient(forward).attribute(inputs, additional_forward_args=args)
        error = None
    else:
        attr, delta = IntegratedGradients(forward).attribute(
            inputs,
            baselines=baseline,
            additional_forward_args=args,
            n_steps=n_steps,
            internal_batch_size=internal_batch_size or tokens.shape[0],
            return_convergence_delta=True,
        )
        error = delta.detach().abs().float().cpu()
    scores = (attr.detach() * mask).sum(-1).float().cpu()
    return EmbeddingAttributions(method, scores, clean.detach().cpu(), error)
