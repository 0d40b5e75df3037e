"""`contribution_vs_field` (inputs and pairs): its numbers against the AOPC tables, its
replicates against the bootstrap's weights applied by hand, and its verdicts on results built
to favour or to defeat the subject."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest
import torch

import cw_lens
from cw_lens.reproduction import Bootstrap, claims, replicates
from cw_lens.reproduction.field_comparison import (
    INPUT_SUBJECT,
    PAIR_SUBJECT,
    best_controls,
    best_others,
)

METHODS = ("contribution_rollout", "attention_rollout", "value_zeroing", "recency")


@pytest.fixture(scope="module")
def model():
    return cw_lens.load_model("testing:tiny-llama")


@pytest.fixture(scope="module")
def inputs(model):
    items = [
        cw_lens.Document("Ann and Bo met; Bo", answer=" ran"),
        cw_lens.Document("Cy, Di and Ed", answer=" ate"),
        cw_lens.Document("Flo saw Gus", answer=" go"),
        cw_lens.Document("Hal and Ivy", answer=" sat"),
        cw_lens.Document("Jo met Kim", answer=" here"),
    ]
    return cw_lens.input_deletion(
        model, items, methods=METHODS, fractions=(0.2, 0.5), n_random=1, progress=False
    )


def test_input_numbers_are_the_aopc_differences(inputs):
    aopc = inputs.aopc()
    table = claims(inputs)["contribution_vs_field_inputs"]
    best = best_others(aopc, INPUT_SUBJECT)
    assert set(best.values()) <= {"attention_rollout", "value_zeroing"}
    measured = table["measured"]
    comp = aopc.loc[INPUT_SUBJECT, "comprehensiveness"]
    comp -= aopc.loc[best["comprehensiveness"], "comprehensiveness"]
    suff = aopc.loc[best["sufficiency"], "sufficiency"] - aopc.loc[INPUT_SUBJECT, "sufficiency"]
    names = [c["number"] for c in table["checks"]]
    assert math.isclose(measured[names[0]], comp, rel_tol=1e-12)
    assert math.isclose(measured[names[1]], suff, rel_tol=1e-12)
    assert measured["best_other"] == best
    assert "random" not in measured["order"]["comprehensiveness"]
    assert measured["n_items"] == 5


def test_the_controls_are_checks_not_rivals(inputs):
    aopc = inputs.aopc()
    claim = claims(inputs)["contribution_vs_field_inputs"]
    controls = best_controls(aopc)
    assert set(controls.values()) <= {"random", "recency"}
    assert set(best_others(aopc, INPUT_SUBJECT).values()).isdisjoint({"random", "recency"})
    checks = {c["number"]: c["value"] for c in claim["checks"]}
    comp = f"inputs_comprehensiveness_{INPUT_SUBJECT}_minus_best_control"
    suff = f"inputs_sufficiency_best_control_minus_{INPUT_SUBJECT}"
    assert len(checks) == 4
    want = aopc.loc[INPUT_SUBJECT, "comprehensiveness"]
    want -= aopc.loc[controls["comprehensiveness"], "comprehensiveness"]
    assert math.isclose(checks[comp], want, rel_tol=1e-12)
    want = aopc.loc[controls["sufficiency"], "sufficiency"] - aopc.loc[INPUT_SUBJECT, "sufficiency"]
    assert math.isclose(checks[suff], want, rel_tol=1e-12)
    assert "recency" not in claim["measured"]["order"]["sufficiency"]


def test_input_replicates_are_the_weighted_means(inputs):
    boot = Bootstrap(resamples=300, seed=3)
    reps = replicates(inputs, boot)
    per_item = inputs.item_aopc()
    weights = boot.weights(len(per_item)).double()
    means = (weights @ torch.tensor(per_item.to_numpy())) / weights.sum(1, keepdim=True)
    column = {c: i for i, c in enumerate(per_item.columns)}
    best = best_others(inputs.aopc(), INPUT_SUBJECT)
    name = f"inputs_comprehensiveness_{INPUT_SUBJECT}_minus_best_other"
    want = (
        means[:, column["comprehensiveness", INPUT_SUBJECT]]
        - means[:, column["comprehensiveness", best["comprehensiveness"]]]
    )
    assert torch.allclose(reps[name], want, rtol=1e-10, atol=1e-12)
    table = claims(inputs, boot)["contribution_vs_field_inputs"]
    assert all(check["interval"] is not None for check in table["checks"])


def _rigged(result, factor):
    """The result with the subject's drops scaled: above 1 it removes what matters most."""
    records = result.records.copy()
    subject = records["method"] == INPUT_SUBJECT
    top = records["mode"] == "comprehensiveness"
    best = records.loc[~subject].groupby(["item", "mode", "fraction"])["drop"]
    high, low = best.transform("max"), best.transform("min")
    key = ["item", "mode", "fraction"]
    extremes = records.loc[~subject, key].assign(high=high, low=low).drop_duplicates(key)
    merged = records.merge(extremes, on=key, how="left")
    spread = (merged["high"] - merged["low"]).abs() + 1.0
    if factor > 0:  # the subject beats every other method on every item
        new = merged["high"].where(top, merged["low"]) + spread.where(top, -spread)
    else:  # it loses to every one
        new = merged["low"].where(top, merged["high"]) - spread.where(top, -spread)
    records.loc[subject, "drop"] = new[subject.to_numpy()].to_numpy()
    return dataclasses.replace(result, records=records)


@pytest.mark.parametrize(("factor", "verdict"), [(1, "yes"), (-1, "no")])
def test_the_verdict_follows_the_evidence(inputs, factor, verdict):
    rigged = _rigged(inputs, factor)
    table = claims(rigged, Bootstrap(resamples=500, seed=0))["contribution_vs_field_inputs"]
    assert table["holds"] == verdict, table["checks"]


def test_losing_to_position_alone_is_a_no(inputs):
    """The subject beats every rival, but the recency control beats it: the verdict is no."""
    rigged = _rigged(inputs, 1)
    records = rigged.records.copy()
    subject = records.loc[records["method"] == INPUT_SUBJECT].set_index(
        ["item", "mode", "fraction"]
    )
    recency = records["method"] == "recency"
    key = records.loc[recency, ["item", "mode", "fraction"]]
    ahead = subject.loc[pd.MultiIndex.from_frame(key), "drop"].to_numpy()
    top = (records.loc[recency, "mode"] == "comprehensiveness").to_numpy()
    records.loc[recency, "drop"] = ahead + 1.0 * top - 1.0 * ~top
    rigged = dataclasses.replace(rigged, records=records)
    claim = claims(rigged, Bootstrap(resamples=500, seed=0))["contribution_vs_field_inputs"]
    holds = {c["number"]: c["holds"] for c in claim["checks"]}
    assert holds[f"inputs_comprehensiveness_{INPUT_SUBJECT}_minus_best_other"] == "yes"
    assert holds[f"inputs_comprehensiveness_{INPUT_SUBJECT}_minus_best_control"] == "no"
    assert claim["holds"] == "no"


def test_a_result_without_rivals_is_refused(model):
    items = [cw_lens.Document("Ann met Bo", answer=" ran")]
    result = cw_lens.input_deletion(
        model, items, methods=("contribution_rollout",), fractions=(0.5,), n_random=1,
        normalise=False, progress=False,
    )  # fmt: skip
    with pytest.raises(cw_lens.InputError, match="at least one other method"):
        claims(result)


def test_pairs_claim_with_the_metrics_of_other_tools(model):
    texts = ["The quick brown fox jumps over the lazy dog.", "Some heads look at one token."]
    result = cw_lens.faithfulness(
        model, texts, metrics=("attention", "value_norm", "value_norm_output", "contribution",
        "alti", "attribution_patching", "random"), fractions=(0.1, 0.5), per_document=True,
        progress=False,
    )  # fmt: skip
    boot = Bootstrap(resamples=300, seed=1)
    table = claims(result, boot)
    assert set(table) == {"faithfulness_order", "contribution_vs_field_pairs"}
    claim = table["contribution_vs_field_pairs"]
    aopc = result.aopc()
    point = pd.DataFrame({m: aopc.loc[("pairs", m)] for m in ("comprehensiveness", "sufficiency")})
    best = best_others(point, PAIR_SUBJECT)
    want = (
        point.loc[PAIR_SUBJECT, "comprehensiveness"]
        - point.loc[best["comprehensiveness"], "comprehensiveness"]
    )
    assert math.isclose(claim["checks"][0]["value"], want, rel_tol=1e-9)
    assert claim["checks"][0]["interval"] is not None
    reps = replicates(result, boot)
    assert claim["checks"][0]["number"] in reps
    # extra random draws are controls, never the best other method
    drawn = cw_lens.faithfulness(
        model, texts, metrics=("attention", "value_norm", "value_norm_output", "contribution",
        "alti", "attribution_patching", "random"), fractions=(0.5,), n_random=3, progress=False,
    )  # fmt: skip
    pairs = claims(drawn)["contribution_vs_field_pairs"]["measured"]
    assert set(pairs["best_other"].values()) <= {"alti", "attribution_patching"}
    assert set(pairs["best_control"].values()) <= {"random", "random#2", "random#3"}
    # without the metrics of other tools only P1's claim is judged
    plain = cw_lens.faithfulness(model, texts, fractions=(0.5,), progress=False)
    assert set(claims(plain)) == {"faithfulness_order"}


def test_a_drawn_sub_corpus_meets_its_own_best_rival(inputs):
    """As a run does, replicates restricted to some items (`Bootstrap(documents=...)`, the
    coverage study's draws) compare the subject with the rival best on those items, not with
    the whole result's best: value zeroing leads on two items, the attention rollout on the
    other three, so the whole result's best is value zeroing and the three items' is not."""
    records = inputs.records.copy()
    comp = records["mode"] == "comprehensiveness"
    first = records["item"].isin([0, 1])
    records.loc[comp & first & (records["method"] == "value_zeroing"), "drop"] += 100.0
    records.loc[comp & ~first & (records["method"] == "attention_rollout"), "drop"] += 60.0
    rigged = dataclasses.replace(inputs, records=records)
    assert best_others(rigged.aopc(), INPUT_SUBJECT)["comprehensiveness"] == "value_zeroing"
    boot = Bootstrap(resamples=50, seed=0, documents=[2, 3, 4])
    name = f"inputs_comprehensiveness_{INPUT_SUBJECT}_minus_best_other"
    reps = replicates(rigged, boot)[name]
    per_item = rigged.item_aopc().dropna().iloc[[2, 3, 4]].mean()
    want = per_item["comprehensiveness", INPUT_SUBJECT]
    want -= per_item["comprehensiveness", "attention_rollout"]
    assert math.isclose(float(reps[boot.resamples]), want, rel_tol=1e-9)
