"""The faithfulness run's numbers against a slow float64 reference, document by document.

The reference ranks every candidate with Python loops over (layer, query) from the dense
contribution weights (`cw_lens.contribution_weights`), builds each removal mask by hand, runs
each document alone with `cw_lens.mask_attention` and scores it in float64 (`log_softmax` of the
float64 logits, a loop over positions). The run under test batches documents, builds its masks
from int16 ranks and keeps float64 device sums (`Outcomes`, a `StackedSums`).

Tolerance: `ATOL` on every per-document NLL sum and every curve point (the NLL of a pass is
float32 in the model; the reference's float64 scoring of the same logits differs by about 1e-6
per position, summed over at most 16 positions), counts exactly.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import cw_lens
from cw_lens.analyses.faithfulness import faithfulness
from cw_lens.data.inputs import prepare_inputs
from cw_lens.data.scoring import run_logits

TEXTS = [
    "attention is not explanation, says one paper",
    "contribution weights project values",
    "a third document, longer than the others by a few words",
]
FRACTIONS = (0.1, 0.5)
MODES = ("comprehensiveness", "sufficiency")
GRANULARITIES = ("pairs", "tokens")
ATOL = 1e-4  # per document NLL sum (<= 16 positions) and per curve point


def reference_masks(model, text, granularity, fraction, mode):
    """Python loops over (layer, query >= 1): the candidates (pairs (head, key <= query), or
    key tokens scored by the sum over heads) sorted by |C| (ties: lower head, then lower key),
    `max(1, round(fraction * n))` of them marked from the top or the bottom."""
    layers, weights = _weights(model, text)
    n = len(weights[0][0])
    heads = model.cfg.n_heads
    masks = {}
    for li, layer in enumerate(layers):
        mask = torch.zeros(1, heads, n, n, dtype=torch.bool)
        for i in range(1, n):
            if granularity == "pairs":
                cands = [(h, j) for h in range(heads) for j in range(i + 1)]
                score = {c: abs(weights[li][c[0]][i][c[1]]) for c in cands}
            else:
                cands = [(None, j) for j in range(i + 1)]
                score = {c: abs(sum(weights[li][h][i][c[1]] for h in range(heads))) for c in cands}
            order = sorted(cands, key=lambda c: (-score[c], c[0] or 0, c[1]))
            k = max(1, math.floor(fraction * len(cands) + 0.5))
            chosen = order[:k] if mode == "comprehensiveness" else order[len(order) - k :]
            for h, j in chosen:
                if h is None:
                    mask[0, :, i, j] = True
                else:
                    mask[0, h, i, j] = True
        masks[layer] = mask
    return masks


@functools.cache
def _weights(model, text):
    """The layers and the dense inter contribution weights `[layer][head][query][key]` (float64
    Python numbers) of one document."""
    result = cw_lens.contribution_weights(model, text, kind="inter")
    return result.layers, result.weights[0].double().tolist()


def reference_nll(model, text, masks=None):
    """(NLL sum, positions) of one document, float64, a loop over positions."""
    batch = prepare_inputs(model, text)
    hooks = () if masks is None else cw_lens.mask_attention(model, masks).hooks
    logits = run_logits(model, batch, hooks)[0].double()
    tokens = batch.tokens[0]
    total, count = 0.0, 0
    for t in range(tokens.shape[0] - 1):
        total -= float(torch.log_softmax(logits[t], -1)[tokens[t + 1]])
        count += 1
    return total, count


def reference(model, texts):
    """{tag: [(NLL sum, count) per document]}, tags as the result names them."""
    out = {"clean": [reference_nll(model, t) for t in texts]}
    for g in GRANULARITIES:
        for mode in MODES:
            for f in FRACTIONS:
                tag = f"{g}|contribution|{mode}|{f}"
                out[tag] = [
                    reference_nll(model, t, reference_masks(model, t, g, f, mode)) for t in texts
                ]
    return out


def check_against_reference(result, ref):
    names, table, _ = result.per_document
    column = {name: i for i, name in enumerate(names)}
    clean_sum = sum(s for s, _ in ref["clean"])
    clean_count = sum(c for _, c in ref["clean"])
    assert result.clean["nll"] == pytest.approx(clean_sum / clean_count, abs=ATOL)
    for tag, docs in ref.items():
        for d, (nll_sum, count) in enumerate(docs):
            assert float(table[d, column[f"count|{tag}"]]) == count, (tag, d)
            assert float(table[d, column[f"nll|{tag}"]]) == pytest.approx(nll_sum, abs=ATOL), (
                tag,
                d,
            )
        if tag == "clean":
            continue
        g, _, mode, f = tag.split("|")
        row = result.curves.query(
            "granularity == @g and mode == @mode and fraction == @f_value",
            local_dict={"g": g, "mode": mode, "f_value": float(f)},
        )
        mean = sum(s for s, _ in docs) / sum(c for _, c in docs)
        assert float(row["nll"].iloc[0]) == pytest.approx(mean, abs=ATOL), tag
        assert float(row["delta_nll"].iloc[0]) == pytest.approx(
            mean - clean_sum / clean_count, abs=ATOL
        )


def run(model, texts, batch_size):
    return faithfulness(
        model,
        texts,
        metrics=("contribution",),
        fractions=FRACTIONS,
        modes=MODES,
        granularity=GRANULARITIES,
        batch_size=batch_size,
        per_document=True,
        progress=False,
    )


@pytest.fixture(scope="module")
def llama_reference(llama):
    return reference(llama, TEXTS)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_curves_and_record_equal_the_float64_reference(llama, llama_reference, batch_size):
    """Tiny Llama; batch sizes 1, 3 and 8 (padding inside a batch) all within ATOL."""
    check_against_reference(run(llama, TEXTS, batch_size), llama_reference)


def test_curves_equal_the_reference_on_gpt2(gpt2):
    """A second architecture (learned positions, LayerNorm, MHA)."""
    check_against_reference(run(gpt2, TEXTS[:2], 2), reference(gpt2, TEXTS[:2]))


def test_the_reference_check_can_fail(llama, llama_reference):
    """The check rejects a planted error of 1e-3 in one document's NLL sum of one pass."""
    result = run(llama, TEXTS, 3)
    names, table, configs = result.per_document
    planted = table.clone()
    planted[1, names.index("nll|tokens|contribution|sufficiency|0.5")] += 1e-3
    result.per_document = (names, planted, configs)
    with pytest.raises(AssertionError):
        check_against_reference(result, llama_reference)


def test_task_outcomes_equal_the_float64_reference(llama):
    """Answer log-probability and greedy accuracy of the clean pass, item by item."""
    items = cw_lens.load_corpus("ioi", n_docs=3, seed=0)
    result = faithfulness(
        llama,
        items,
        metrics=("contribution",),
        fractions=(0.5,),
        modes=("comprehensiveness",),
        batch_size=2,
        per_document=True,
        progress=False,
    )
    from cw_lens.data.inputs import answer_spans

    batch, spans = answer_spans(llama, list(items), True)
    logprobs, correct = [], []
    for row, (start, end) in enumerate(spans):  # one item at a time, unpadded
        width = int(batch.mask[row].sum())
        tokens = batch.tokens[row : row + 1, :width]
        with torch.inference_mode():
            logits = llama(tokens)[0].double()
        lp, ok = 0.0, True
        for t in range(start, end):
            lp += float(torch.log_softmax(logits[t - 1], -1)[tokens[0, t]])
            ok &= int(logits[t - 1].argmax()) == int(tokens[0, t])
        logprobs.append(lp)
        correct.append(float(ok))
    names, table, _ = result.per_document
    got = table[:, names.index("logprob|clean")]
    assert torch.allclose(got, torch.tensor(logprobs, dtype=got.dtype), atol=ATOL)
    assert result.clean["logprob"] == pytest.approx(sum(logprobs) / 3, abs=ATOL)
    assert result.clean["accuracy"] == pytest.approx(sum(correct) / 3, abs=1e-12)


@pytest.mark.slow
def test_curves_equal_the_reference_on_the_embedded_model(smollm):
    """SmolLM2 (GQA, 9 heads): one short document, the pairs granularity at 10%."""
    text = TEXTS[1]
    result = faithfulness(
        smollm,
        [text],
        metrics=("contribution",),
        fractions=(0.1,),
        modes=("comprehensiveness",),
        per_document=True,
        progress=False,
    )
    clean = reference_nll(smollm, text)
    ablated = reference_nll(
        smollm, text, reference_masks(smollm, text, "pairs", 0.1, "comprehensiveness")
    )
    names, table, _ = result.per_document
    tag = "pairs|contribution|comprehensiveness|0.1"
    assert float(table[0, names.index("nll|clean")]) == pytest.approx(clean[0], abs=ATOL)
    assert float(table[0, names.index(f"nll|{tag}")]) == pytest.approx(ablated[0], abs=ATOL)
    assert float(table[0, names.index(f"count|{tag}")]) == ablated[1]
