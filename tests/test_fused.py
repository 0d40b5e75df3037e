"""`corpus_analyses`: several corpus analyses from one forward pass per batch, each result the
one its own function returns with the same arguments (both feed the same accumulator the same
blocks, so they are equal bit for bit).

Checked on three tiny architectures (grouped-query attention, biases, a parallel block) and on
the embedded SmolLM2, with and without the per-document record the main job keeps. A result is
compared field by field (`same_results.assert_same`): every stacked sum, histogram count,
sampled factor row and per-document record it holds. Accumulators given as objects, and one of
a user's own, ride along on the same pass.
"""

from __future__ import annotations

import pytest
from arch_checks import built
from same_results import assert_same

import cw_lens
from cw_lens.core.accumulators import StackedSums
from cw_lens.core.errors import InputError

FUNCTIONS = {
    "sinks": cw_lens.sink_statistics,
    "selection": cw_lens.selection_geometry,
    "taxonomy": cw_lens.head_taxonomy,
    "ablation": cw_lens.sink_ablation,
}
# options that reach every part of each analysis on short documents (a sink head needs queries
# at min_query or later; the random rule of the selection, a small grid)
OPTIONS = {
    "sinks": {"min_query": 4, "samples_per_head": 16, "seed": 3},
    "selection": {"n_random": 4, "n_grid": [1, 2, 4], "seed": 2},
    "taxonomy": {},
    "ablation": {"scale": 0.5},
}
# a GQA Llama, GPT-2's biases, Phi's parallel attention and MLP (tests/architectures.py)
ARCHITECTURES = ("Llama", "GPT-2", "Phi")


def bridged(architecture: str):
    """The tiny model of `architecture` as a bridge (the environments without one skip: there
    the other tests of this module run on the embedded model's HookedTransformer)."""
    model = built(architecture).bridge
    if model is None:
        pytest.skip(f"no TransformerBridge of the tiny {architecture} in this TransformerLens")
    return model


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: faster on one thread


def accumulated(result) -> dict:
    """The tensors a sink-statistics result holds (its sums, curve, samples and record)."""
    held = {"sums": result.sums, "curve": result.curve_sums, "samples": result.samples_table}
    if result.record is not None:
        held["record"] = result.record
    return held


def assert_same_results(fused, alone: dict) -> None:
    assert list(fused) == list(alone)
    for name, result in alone.items():
        assert_same(fused[name], result, name)
        if name == "sinks":
            assert_same(accumulated(fused[name]), accumulated(result), "sinks accumulator")
            assert_same(fused[name].heads(), result.heads(), "sinks.heads()")


def run_both(model, corpus, per_document: bool, options: dict = OPTIONS):
    common = dict(batch_size=2, progress=False, per_document=per_document)
    alone = {name: FUNCTIONS[name](model, corpus, **o, **common) for name, o in options.items()}
    fused = cw_lens.corpus_analyses(model, corpus, analyses=options, **common)
    return fused, alone


@pytest.mark.parametrize("per_document", [False, True], ids=["sums", "per-document"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_result_is_its_own_functions(architecture, per_document):
    model = bridged(architecture)
    corpus = cw_lens.load_corpus(n_docs=5, max_tokens=24, model=model)
    fused, alone = run_both(model, corpus, per_document)
    assert_same_results(fused, alone)
    assert fused.n_documents == 5 and set(fused.seconds) == set(OPTIONS)
    assert all(seconds > 0 for seconds in fused.seconds.values())


def test_the_comparison_sees_a_different_option_and_texts_work_as_a_corpus():
    """A fused run with another sink seed is not the standalone one (the check can fail), and
    a list of texts streams as the corpus it makes."""
    model = bridged("Llama")
    texts = ["The quick brown fox jumps over the lazy dog.", "Heads look at BOS, mostly."]
    options = {"sinks": OPTIONS["sinks"], "taxonomy": {}}
    fused, alone = run_both(model, texts, per_document=True, options=options)
    assert_same_results(fused, alone)
    other = cw_lens.corpus_analyses(
        model, texts, analyses={"sinks": {**OPTIONS["sinks"], "seed": 4}}, progress=False
    )
    with pytest.raises(AssertionError):
        assert_same(accumulated(other.sinks), accumulated(alone["sinks"]))


def test_names_and_options_are_checked():
    model = bridged("Llama")
    texts = ["One text for the checks."]
    for analyses, match in (
        (("sinks", "pruning"), "at most once"),
        (("sinks", "sinks"), "at most once"),
        ((), "at most once"),
        ([cw_lens.SinkStatisticsAccumulator(model, texts), "sinks"], "at most once"),
        ("sinks", "list of names"),
        ({"sinks": {"batch_size": 4}}, "shared by every analysis"),
        ({"taxonomy": {"n_random": 3}}, "n_random"),
    ):
        with pytest.raises(InputError, match=match):
            cw_lens.corpus_analyses(model, texts, analyses=analyses, progress=False)


@pytest.mark.model
@pytest.mark.slow
def test_on_the_embedded_model_each_result_is_its_own_functions(smollm):
    corpus = cw_lens.load_corpus(n_docs=4, max_tokens=64, model=smollm)
    options = {name: {} for name in FUNCTIONS}  # every default, as the main job runs them
    fused, alone = run_both(smollm, corpus, per_document=True, options=options)
    assert_same_results(fused, alone)


class _QueryCount(cw_lens.Accumulator):
    """A user's accumulator: real query rows per layer, from the blocks it is handed."""

    name = "queries"

    def __init__(self, model):
        self.layers = [0, model.cfg.n_layers - 1]
        self.sums = StackedSums(["rows"], (2,))

    def update(self, block):
        rows = block.acts.mask[:, block.queries].sum(-1, keepdim=True)  # [batch, 1]
        self.sums.add(rows, at=self.layers.index(block.layer))

    def finish(self, stats):
        return self.sums.to_host().column("rows")


def test_accumulators_given_as_objects_and_a_users_own_ride_along():
    """Accumulators built with their options equal the functions' results; a user's own sees
    every real query row of the layers it reads, once."""
    model = bridged("Llama")
    corpus = cw_lens.load_corpus(n_docs=5, max_tokens=24, model=model)
    _, alone = run_both(model, corpus, per_document=False, options={"sinks": OPTIONS["sinks"]})
    sinks = cw_lens.SinkStatisticsAccumulator(model, corpus, **OPTIONS["sinks"], batch_size=2)
    mine = _QueryCount(model)
    fused = cw_lens.corpus_analyses(
        model,
        corpus,
        analyses=[sinks, mine, "selection"],
        batch_size=2,
        progress=False,
    )
    assert list(fused) == ["sinks", "queries", "selection"]
    assert_same(fused["sinks"], alone["sinks"], "sinks")
    assert_same(accumulated(fused["sinks"]), accumulated(alone["sinks"]), "sinks tensors")
    n_tokens = sum(len(d.tokens) + 1 for d in corpus)  # each with its BOS
    assert fused["queries"].tolist() == [n_tokens, n_tokens]
    assert fused.selection is not None and fused.taxonomy is None
