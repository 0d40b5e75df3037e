r"""Value zeroing (Mohebbi et al. 2023, "Quantifying Context Mixing in Transformers"): how much
each layer's output at position `i` changes when token `j`'s value vectors are zeroed.

For every token `j`, one forward pass zeroes `v_j` in every head of every layer at once, while
each layer's input is the clean pass's (the clean block output is patched back after every
block, so the layers do not compound): the deviation of layer `l`'s output at position `i` is

    VZ_l[i, j] = 1 - cos(x_{l+1, i}, x~_{l+1, i}^{(j)})

row-normalised over `j <= i` (a row of zeros stays zero). This is inseq's
`ops/value_zeroing.py` with cosine similarity, computed for every layer in `T + 1` passes per
sequence of `T` tokens; here a pass runs many `(sequence, j)` copies side by side.

Zeroing `v_j` (the whole value vector, its bias included) leaves the attention weights as
they are, so it is exactly the removal of the term `alpha_ij^h v_j` from every `z_i^h`: the
key masking of [`cw_lens.mask_attention`][cw_lens.mask_attention] applied to key `j` in one layer.
It is realised that way, so it holds on both routes by which models compute attention; the
clean states are patched in at `hook_resid_post`, and every pass is checked to end with the
clean logits (else the patch did not reach the model:
[`UnsupportedModelError`][cw_lens.UnsupportedModelError]).

Example:

    import cw_lens
    from cw_lens.data.inputs import prepare_inputs
    from cw_lens.models.value_zeroing import value_zeroing

    model = cw_lens.load_model("testing:tiny-llama")
    batch = prepare_inputs(model, ["The cat sat on the mat."])
    value_zeroing(model, batch).shape  # [batch, layer, query, key]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from cw_lens.core.errors import InputError, UnsupportedModelError
from cw_lens.models.access import model_access
from cw_lens.models.batch import TokenBatch
from cw_lens.models.capture import CONSISTENCY_RTOL, HALF_PRECISION_RTOL
from cw_lens.models.interventions import mask_attention


def value_zeroing(
    model: Any, batch: TokenBatch, *, rows_per_pass: int | None = None
) -> Float[Tensor, "batch layer query key"]:
    """Value-zeroing scores of every layer, row-normalised (`VZ_l[i, j]`, 0 for `j > i`).

    Args:
        model: A TransformerLens model whose residual-stream hooks are checked
            (`cw_lens.verify_flow`; the caller's responsibility).
        batch: Right-padded documents.
        rows_per_pass: `(sequence, zeroed token)` copies per forward pass (default: the batch's
            size). Cost: `1 + sum of the lengths` sequence-passes in all.

    Returns:
        `[batch, layer, query, key]` float32 on the host (0 at padding).

    Raises:
        InputError: On a bad `rows_per_pass`.
        UnsupportedModelError: When patching the clean block outputs back does not reach
            the model's output.
    """
    access = model_access(model)
    n_layers = model.cfg.n_layers
    tokens = batch.tokens.to(access.device)
    n_batch, width = tokens.shape
    rows_per_pass = rows_per_pass or n_batch
    if isinstance(rows_per_pass, bool) or not isinstance(rows_per_pass, int) or rows_per_pass < 1:
        raise InputError(f"rows_per_pass must be a positive integer, got {rows_per_pass!r}.")
    names = [access.hook_name("resid_post", layer) for layer in range(n_layers)]
    clean: dict[int, Tensor] = {}

    def keep(layer: int) -> Callable:
        def fn(t: Tensor, hook: Any) -> None:
            clean[layer] = t.detach()

        return fn

    with torch.no_grad(), access.hooks([(n, keep(layer)) for layer, n in enumerate(names)]):
        clean_logits = access.forward(tokens).float()
    lengths = batch.lengths.tolist()
    pairs = [(b, j) for b in range(n_batch) for j in range(lengths[b])]
    scores = torch.zeros(n_batch, n_layers, width, width, dtype=torch.float64, device="cpu")
    rtol = CONSISTENCY_RTOL.get(access.parameter_dtype(), HALF_PRECISION_RTOL)
    for start in range(0, len(pairs), rows_per_pass):
        chunk = pairs[start : start + rows_per_pass]
        docs = torch.tensor([b for b, _ in chunk], device=access.device)
        keys = torch.tensor([j for _, j in chunk], device=access.device)
        zeroed = torch.zeros(len(chunk), 1, 1, width, dtype=torch.bool, device=access.device)
        zeroed[torch.arange(len(chunk), device=access.device), 0, 0, keys] = True
        deviation: dict[int, Tensor] = {}

        def patch(layer: int, docs: Tensor = docs, deviation: dict = deviation) -> Callable:
            def fn(t: Tensor, hook: Any) -> Tensor:
                ref = clean[layer][docs]
                cos = torch.nn.functional.cosine_similarity(
                    t.double(), ref.double(), dim=-1, eps=1e-30
                )
                deviation[layer] = (1.0 - cos).clamp_min(0.0).cpu()  # [rows, query]
                return ref.to(t.dtype)

            return fn

        masks = dict.fromkeys(range(n_layers), zeroed)
        hooks = [(n, patch(layer)) for layer, n in enumerate(names)]
        with torch.no_grad(), mask_attention(model, masks), access.hooks(hooks):
            logits = access.forward(tokens[docs]).float()
        reference = clean_logits[docs]
        err = (logits - reference).abs().amax() / reference.abs().amax().clamp_min(1e-30)
        if len(deviation) != n_layers or not float(err) <= rtol:
            raise UnsupportedModelError(
                f"{access.architecture}: patching the clean block outputs back at hook_resid_post "
                f"does not reach the model's output (relative logit change {float(err):.2e}), "
                "so value zeroing cannot isolate a layer on this model."
            )
        rows_b, rows_j = docs.cpu(), keys.cpu()
        for layer in range(n_layers):
            scores[rows_b, layer, :, rows_j] = deviation[layer].double()
    positions = torch.arange(width, device="cpu")
    causal = positions[:, None] >= positions[None, :]
    real = batch.mask.cpu()
    keep_mask = causal[None] & real[:, None, :] & real[:, :, None]  # [batch, query, key]
    scores = scores * keep_mask[:, None]
    total = scores.sum(-1, keepdim=True)
    scores = torch.where(total > 0, scores / total.clamp_min(1e-300), scores)
    return scores.float()
