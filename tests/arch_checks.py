"""The measurements of the architecture matrix: cw_lens against the HF reference, as numbers.

Shared by ``tests/test_architectures.py`` (which asserts on them) and
``tests/architecture_table.py`` (which prints the table of docs/models.md). Every error is relative:

- contribution weights: max over rows of ``max_j |ours - ref| / max_j |ref|`` (a row is one
  head and query for intra, all heads of one query for inter — the entries that share one
  normalisation), divided by ``max(1, kappa / 20)`` where ``kappa = sum_j alpha ||pv_j|| /
  ||o_i||`` is the row's condition number (float32 can only resolve an output that cancels to
  ``kappa * 1e-7``; ``tests/reference.tolerance``);
- interventions: max over positions of ``||logits_ours - logits_ref|| / ||logits_ref||``, where
  the reference runs the float64 HF twin with an exact ``z`` edit (``hf_reference``).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from architectures import BY_NAME, Built, build
from hf_reference import (
    LayerRef,
    capture,
    mask_attention_logits,
    patch_sink_logits,
    remove_heads_logits,
)
from reference import assert_rows_close, causal_rows, dense_contributions, tolerance

import cw_lens
from cw_lens.models.testing import BYTE_VOCAB

N_POS = 16
PADDED_LENGTH = 11  # the second row of the padded batch
SINK_LAYER, SINK_HEADS, SINK_SCALE = 0, [0, 3], 0.25
MASK_LAYER = 0
REMOVED = [(0, 1), (1, 2)]


@cache
def built(name: str) -> Built:
    """Each architecture is built once per process (tests share it through this cache)."""
    return build(BY_NAME[name])


def tokens() -> torch.Tensor:
    """Two random byte sequences of ``N_POS`` tokens, BOS first."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randint(0, BYTE_VOCAB, (2, N_POS), generator=gen)
    t[:, 0] = BYTE_VOCAB
    return t


@cache
def clean(name: str) -> tuple[list[LayerRef], torch.Tensor]:
    """The HF reference of every layer on :func:`tokens`, and the HF logits (cached)."""
    b = built(name)
    return capture(b.arch, b.hf, tokens())


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """:func:`tokens` with the second row cut to ``PADDED_LENGTH`` and right-padded.

    In a causal model the first ``n`` positions do not see later tokens, so the reference of a
    cut row is the top-left ``n x n`` block of the full row's reference.
    """
    t = tokens()
    lengths = [N_POS, PADDED_LENGTH]
    mask = torch.zeros_like(t)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        t[i, n:] = BYTE_VOCAB + 2  # PAD
    return t, mask, lengths


def row_error(actual: torch.Tensor, ref: dict[str, torch.Tensor], kind: str) -> float:
    """Conditioned row-relative error of one layer ``[batch, head, query, key]`` (see module)."""
    n = actual.shape[-1]
    valid = causal_rows(n)[None, None]
    tol = tolerance(ref, kind)
    rows = (-1,) if kind == "intra" else (1, -1)
    if kind == "inter":
        tol = tol.amax(1, keepdim=True)
    return assert_rows_close(
        actual, ref["weights"], float("inf"), valid, what=kind, row_dims=rows, row_tolerance=tol
    )


@cache
def contribution_result(name: str, kind: str, padded: bool = False) -> Any:
    """``cw_lens.contribution_weights`` on :func:`tokens` or :func:`padded_batch` (cached)."""
    b = built(name)
    if padded:
        toks, mask, _ = padded_batch()
        return cw_lens.contribution_weights(b.bridge, toks, kind=kind, attention_mask=mask)
    return cw_lens.contribution_weights(b.bridge, tokens(), kind=kind)


def contribution_error(name: str, kind: str, padded: bool = False) -> float:
    """Worst error of ``cw_lens.contribution_weights`` over every layer and sequence."""
    result = contribution_result(name, kind, padded)
    lengths = padded_batch()[2] if padded else [N_POS, N_POS]
    refs, _ = clean(name)
    worst = 0.0
    for i, n in enumerate(lengths):
        for layer, ref in enumerate(refs):
            dense = dense_contributions(
                ref.alpha[i : i + 1, :, :n, :n], ref.v[i : i + 1, :n], ref.W_O, kind
            )
            ours = result.weights[i : i + 1, layer, :, :n, :n]
            worst = max(worst, row_error(ours, dense, kind))
    return worst


def _logits(bridge: Any, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return bridge(toks).double()


def logits_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max over positions of ``||ours - ref|| / ||ref||``."""
    return float(((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def clean_logits_error(name: str) -> float:
    """The bridge's own logits against the HF model's (float64 both)."""
    return logits_error(_logits(built(name).bridge, tokens()), clean(name)[1])


def pair_mask() -> torch.Tensor:
    """A random 30% of the causal (query, key) pairs of each head, ``[1, head, query, key]``."""
    gen = torch.Generator().manual_seed(7)
    keep = torch.rand(1, 4, N_POS, N_POS, generator=gen) < 0.3
    return keep & causal_rows(N_POS)


def interventions(name: str, which: str) -> tuple[Any, torch.Tensor]:
    """cw_lens' hook set for ``which`` and the HF reference logits under the same edit."""
    b = built(name)
    refs, _ = clean(name)
    toks = tokens()
    if which == "patch_sink":
        ref = patch_sink_logits(
            b.arch, b.hf, toks, refs[SINK_LAYER], SINK_LAYER, SINK_HEADS, SINK_SCALE
        )
        return cw_lens.patch_sink(
            b.bridge, layers=[SINK_LAYER], heads=SINK_HEADS, scale=SINK_SCALE
        ), ref
    if which == "mask_attention":
        mask = pair_mask()
        ref = mask_attention_logits(b.arch, b.hf, toks, refs[MASK_LAYER], MASK_LAYER, mask)
        return cw_lens.mask_attention(b.bridge, {MASK_LAYER: mask}), ref
    if which == "remove_heads":
        by_layer: dict[int, list[int]] = {}
        for layer, head in REMOVED:
            by_layer.setdefault(layer, []).append(head)
        ref = remove_heads_logits(b.arch, b.hf, toks, by_layer)
        return cw_lens.remove_heads(b.bridge, REMOVED), ref
    raise ValueError(which)


def intervention_error(name: str, which: str) -> tuple[float, float]:
    """(error of cw_lens' intervention vs the HF reference, size of its effect) on logits."""
    hooks, ref = interventions(name, which)
    with hooks:
        ours = _logits(built(name).bridge, tokens())
    return logits_error(ours, ref), logits_error(ref, clean(name)[1])


INTERVENTIONS = ("patch_sink", "mask_attention", "remove_heads")


def refusal(model: Any) -> str | None:
    """cw_lens's refusal of ``model`` as text, ``None`` when ``verify_model`` accepts it.

    ``verify_model`` may raise ``UnsupportedModelError`` or return a failed report whose
    ``raise_if_failed`` raises it; any other exception propagates (a raw crash is a bug).
    """
    try:
        report = cw_lens.verify_model(model)
    except cw_lens.UnsupportedModelError as err:
        return str(err)
    if report.ok:
        return None
    try:
        report.raise_if_failed()
    except cw_lens.UnsupportedModelError as err:
        return str(err)
    raise AssertionError(f"verify_model failed ({report.problems}) but raise_if_failed did not")
