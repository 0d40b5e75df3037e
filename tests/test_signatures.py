"""One vocabulary of arguments across the public API (every callable in ``cw_lens.__all__``).

A new synonym of a canonical argument name, a second default for ``progress``, or a parameter
after the model and the input that is not keyword-only fails here. Old spellings stay accepted
for one minor version, with a DeprecationWarning (``cw_lens.core.deprecation``).
"""

from __future__ import annotations

import inspect
import warnings

import pytest

import cw_lens
from cw_lens.core.deprecation import keyword_only, renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.models.testing import tiny_llama

# canonical name -> synonyms no public signature may use
CANONICAL = {
    "n_random": ("n_draws", "random_draws", "draws", "n_random_draws", "n_samples"),
    "progress": ("verbose", "show_progress", "pbar", "tqdm"),
    "model": ("tokenizer", "tok", "hooked_model"),
    "layers": ("layer_list", "layer_ids", "blocks"),
    "sink_positions": ("sinks", "sink_pos", "sink_tokens"),
    "seed": ("random_state", "rng", "random_seed"),
    "batch_size": ("bs", "docs_per_batch"),
    "prepend_bos": ("add_bos", "bos"),
    "attention_mask": ("mask",),
}
PROGRESS_DEFAULT = True
KIND_VALUES = ("intra", "inter")  # `kind` is the contribution normalisation, nothing else
# positional parameters each public callable may take (default 2: the model and its input)
POSITIONAL = {
    "cache_names": 1,
    "load_corpus": 1,
    "load_model": 1,
    "verify_model": 1,
    "compare_runs": 1,
    "stream_contributions": 3,  # (model, inputs, consumer)
    "stream_shares": 3,
    "geometric_prf": 3,  # pure math on tensors: (values, attention, n)
    "geometric_prf_batched": 3,
}


def public_functions():
    for name in sorted(cw_lens.__all__):
        obj = getattr(cw_lens, name)
        if inspect.isfunction(obj):
            yield name, inspect.signature(obj)


FUNCTIONS = list(public_functions())


def test_the_table_covers_real_functions():
    names = {name for name, _ in FUNCTIONS}
    assert len(names) > 25 and set(POSITIONAL) <= names


@pytest.mark.parametrize(("name", "sig"), FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_no_synonyms_of_canonical_names(name, sig):
    forbidden = {syn: canon for canon, syns in CANONICAL.items() for syn in syns}
    bad = {p: forbidden[p] for p in sig.parameters if p in forbidden}
    assert not bad, f"{name}: use the canonical names {bad}"


@pytest.mark.parametrize(("name", "sig"), FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_progress_and_kind_mean_one_thing(name, sig):
    if "progress" in sig.parameters:
        assert sig.parameters["progress"].default is PROGRESS_DEFAULT, name
    if "kind" in sig.parameters:
        assert sig.parameters["kind"].default in KIND_VALUES, name


@pytest.mark.parametrize(("name", "sig"), FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_keyword_only_after_the_model_and_the_input(name, sig):
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p, v in sig.parameters.items() if v.kind in kinds]
    allowed = POSITIONAL.get(name, 2)
    assert len(positional) <= allowed, f"{name}: make {positional[allowed:]} keyword-only"


# --------------------------------------------------------------------------- the shims
def test_renamed_kwargs_warn_and_forward():
    @renamed_kwargs(old="new")
    def f(*, new=0):
        return new

    with pytest.warns(DeprecationWarning, match=r"f\(old=...\) is now f\(new=...\)"):
        assert f(old=3) == 3
    with pytest.raises(InputError, match="pass only new="):
        f(old=1, new=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(new=4) == 4
    assert list(inspect.signature(f).parameters) == ["new"]


def test_keyword_only_accepts_old_positional_calls():
    @keyword_only("b", "c")
    def g(a, *, b=1, c=2):
        return a, b, c

    with pytest.warns(DeprecationWarning, match=r"pass b=..., c=... by keyword"):
        assert g(0, 5, 6) == (0, 5, 6)
    with pytest.raises(TypeError, match="positional"):
        g(0, 1, 2, 3)


@pytest.mark.parametrize(
    ("function", "old", "new"),
    [
        (cw_lens.prune_heads, "n_draws", "n_random"),
        (cw_lens.faithfulness, "random_draws", "n_random"),
        (cw_lens.load_corpus, "tokenizer", "model"),
        (cw_lens.RouteGraphResult.top, "kind", "edge"),
    ],
)
def test_old_spellings_are_registered(function, old, new):
    assert function.__renamed_kwargs__ == {old: new}
    assert new in inspect.signature(function).parameters


def test_old_spellings_still_run():
    model = tiny_llama(seed=0, n_layers=2)
    with pytest.warns(DeprecationWarning, match="tokenizer"):
        old = cw_lens.load_corpus(n_docs=2, max_tokens=16, tokenizer=model)
    assert [d.text for d in old] == [
        d.text for d in cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
    ]
    with pytest.warns(DeprecationWarning, match="target=..., threshold=..."):
        g = cw_lens.routes(model, "hello world", -1, 0.05)
    assert g.threshold == 0.05
    with pytest.warns(DeprecationWarning, match=r"top\(kind=...\)"):
        assert g.top(kind=None).equals(g.top(edge=None))
