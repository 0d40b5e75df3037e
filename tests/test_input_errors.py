"""What a newcomer's first mistakes get: a model name instead of a model, negative head indices,
sink positions beyond a document, a corpus printed in a notebook, an intervention pickled."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

import cw_lens
from cw_lens.core.errors import InputError
from cw_lens.models.edits import HookSet
from cw_lens.models.testing import tiny_llama

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Short."]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, n_layers=2)


# --------------------------------------------------------------------------- a name, not a model
def _model_first() -> list[str]:
    """The public functions whose first parameter is the model."""
    return [
        name
        for name in sorted(cw_lens.__all__)
        if inspect.isfunction(fn := getattr(cw_lens, name))
        and list(inspect.signature(fn).parameters)[:1] == ["model"]
    ]


ARGUMENTS = {  # what each takes after the model (the rest: one text)
    "stream_contributions": ("a text", print),
    "stream_shares": ("a text", print),
    "patch_sink": (),
    "verify_model": (),
    "remove_heads": ([(0, 0)],),
    "mask_attention": ({0: torch.zeros(1, dtype=torch.bool)},),
}


def _call(name: str, model):
    if name == "sink_patcher":
        pytest.importorskip("anywidget")
    return getattr(cw_lens, name)(model, *ARGUMENTS.get(name, ("a text",)))


@pytest.mark.parametrize("name", _model_first())
def test_a_model_name_says_how_to_load_it(name):
    with pytest.raises(InputError, match=r"load it first: `model = cw_lens\.load_model\('gpt2'\)`"):
        _call(name, "gpt2")


@pytest.mark.parametrize("name", _model_first())
def test_no_model_says_how_to_load_one(name):
    with pytest.raises(InputError, match=r"The model is None: load it first: `model = cw_lens"):
        _call(name, None)


def test_the_model_is_checked_where_every_analysis_reaches_it():
    assert len(_model_first()) >= 20
    with pytest.raises(InputError, match=r"cw_lens\.load_model\('gpt2'\)"):
        cw_lens.contribution_weights_from_cache({}, "gpt2", layer=0)
    with pytest.raises(InputError, match=r"the path 'models/x\.gguf'.*load_model\('models/x"):
        cw_lens.contribution_weights(__import__("pathlib").Path("models/x.gguf"), "a text")


# --------------------------------------------------------------------------- negative heads
def test_negative_heads_count_from_the_end_like_layers(model):
    n = model.cfg.n_heads
    last = cw_lens.contribution_weights(model, TEXTS[0], layers=-1, heads=-1)
    same = cw_lens.contribution_weights(model, TEXTS[0], layers=1, heads=n - 1)
    assert (last.layers, last.heads) == ([1], [n - 1]) == (same.layers, same.heads)
    torch.testing.assert_close(last.weights, same.weights, rtol=0, atol=0, equal_nan=True)
    both = cw_lens.contribution_weights(model, TEXTS[0], layers=[1], heads=[0, -1])
    assert both.heads == [0, n - 1]
    with pytest.raises(InputError, match=rf"Head {-n - 1} is out of range: this model has {n}"):
        cw_lens.contribution_weights(model, TEXTS[0], heads=-n - 1)
    tokens = model.to_tokens(TEXTS[0])
    with cw_lens.patch_sink(model, layers=[1], heads=[-1]):
        a = model(tokens)
    with cw_lens.patch_sink(model, layers=[1], heads=[n - 1]):
        b = model(tokens)
    assert torch.equal(a, b)


def test_negative_heads_are_documented():
    for fn in (cw_lens.contribution_weights, cw_lens.patch_sink, cw_lens.stream_contributions):
        assert "`-1` is the last head" in " ".join(inspect.getdoc(fn).split()), fn.__name__


# --------------------------------------------------------------------------- sinks beyond a text
SINK_ANALYSES = {
    "sink_statistics": lambda m, s: cw_lens.sink_statistics(m, TEXTS, sink_positions=s),
    "sink_rates": lambda m, s: cw_lens.sink_rates(m, TEXTS, sink_positions=s),
    "sink_ablation": lambda m, s: cw_lens.sink_ablation(m, TEXTS, sink_positions=s),
    "selection_geometry": lambda m, s: cw_lens.selection_geometry(m, TEXTS, sink_positions=s),
    "head_taxonomy": lambda m, s: cw_lens.head_taxonomy(m, TEXTS, sink_positions=s),
    "prune_heads": lambda m, s: cw_lens.prune_heads(m, TEXTS, sink_positions=s),
}


@pytest.mark.parametrize("name", sorted(SINK_ANALYSES))
def test_a_sink_beyond_a_document_names_it(model, name):
    """`sink_positions=[20]` with a 7-token second document: refused before any pass, naming
    the document and its length (it used to warn and return NaN)."""
    n_short = int(model.to_tokens(TEXTS[1]).shape[1])
    with pytest.raises(InputError, match=rf"sink_positions=\[20\] lies beyond document 1, which "
                       rf"has {n_short} tokens \(positions 0\.\.{n_short - 1}\); 1 of the 2 "
                       "documents are too short"):  # fmt: skip
        SINK_ANALYSES[name](model, [20])


def test_a_sink_beyond_one_text(model):
    n = int(model.to_tokens(TEXTS[0]).shape[1])
    with pytest.raises(InputError, match=rf"lies beyond the text, which has {n} tokens"):
        cw_lens.compare_sink_patch(model, TEXTS[0], sink_positions=[100])
    with pytest.raises(InputError, match=r"pass positions below"):
        cw_lens.sink_statistics(model, TEXTS[0], sink_positions=[0, 100], progress=False)


def test_sinks_inside_every_document_run(model):
    """Positions inside the shortest document are accepted (padding never shifts them)."""
    n_short = int(model.to_tokens(TEXTS[1]).shape[1])
    rates = cw_lens.sink_rates(model, TEXTS, sink_positions=[n_short - 1])
    assert rates.shape[0] == 2
    stats = cw_lens.sink_statistics(model, TEXTS, sink_positions=[1], min_query=2, progress=False)
    assert stats.sinks == "1"


# --------------------------------------------------------------------------- a corpus's repr
def test_a_corpus_prints_one_short_line(model):
    corpus = cw_lens.load_corpus(n_docs=8, max_tokens=128, model=model)
    text = repr(corpus)
    assert len(text) < 120, text
    assert text.startswith("Corpus('pydoc', 8 documents x ") and "tokens" in text, text
    assert "source='pydoc_data.topics'" in text and "seed=0" in text
    assert "\n" not in text and corpus.documents[0].text[:20] not in text
    assert repr(corpus[:2]).startswith("Corpus('pydoc', 2 documents")
    untokenised = cw_lens.load_corpus("ioi", n_docs=3)
    assert repr(untokenised) == "Corpus('ioi', 3 documents, not tokenised, source='ioi', seed=0)"
    IPython = pytest.importorskip("IPython.lib.pretty")
    assert IPython.pretty(corpus) == text


# --------------------------------------------------------------------------- hook sets pickle
def _interventions(model):
    n = int(model.to_tokens(TEXTS[0]).shape[1])
    mask = torch.ones(1, 1, n, n, dtype=torch.bool).tril(-1)
    return {
        "patch_sink": cw_lens.patch_sink(model, layers=[1], heads=[0, -1]),
        "norm_matched": cw_lens.patch_sink(model, mode="norm_matched"),
        "remove_heads": cw_lens.remove_heads(model, [(0, 1)]),
        "mask_attention": cw_lens.mask_attention(model, {0: mask}),
        "combined": cw_lens.patch_sink(model, layers=[0]) + cw_lens.remove_heads(model, [(1, 2)]),
    }


@pytest.mark.parametrize(
    "kind", ["patch_sink", "norm_matched", "remove_heads", "mask_attention", "combined"]
)
def test_a_hook_set_pickles_as_its_spec_and_acts_the_same(model, kind):
    hook_set = _interventions(model)[kind]
    tokens = model.to_tokens(TEXTS[0])
    clean = model(tokens)
    with hook_set:
        expected = model(tokens)
    assert not torch.equal(expected, clean)
    data = pickle.dumps(hook_set)
    assert len(data) < 20_000  # the edits, not the model
    loaded = pickle.loads(data)
    assert loaded.model is model and len(loaded) == len(hook_set)
    assert repr(loaded) == repr(hook_set)
    with loaded:
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)
    with copy.deepcopy(hook_set):
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)
    torch.testing.assert_close(model(tokens), clean, rtol=0, atol=0)  # hooks removed on exit


def test_a_hook_set_away_from_its_model_binds_again(model):
    hook_set = cw_lens.patch_sink(model, layers=[1])
    state = hook_set.__getstate__()
    state["model_key"] = "a model of another process"
    away = HookSet.__new__(HookSet)
    away.__setstate__(state)
    assert away.model is None and "unbound" in repr(away)
    with pytest.raises(InputError, match=r"unpickled away from its model; bind it first"):
        with away:
            pass
    tokens = model.to_tokens(TEXTS[0])
    with hook_set:
        expected = model(tokens)
    with away.bind(model):
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)


def test_hand_made_hooks_pickle_as_pickle_carries_their_functions(model):
    by_hand = [("blocks.0.hook_resid_pre", lambda t, hook: t)]
    closure = cw_lens.remove_heads(model, [(0, 0)]) + by_hand
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(closure)
