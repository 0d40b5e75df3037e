"""One vocabulary of arguments across the public API (every callable in ``cw_lens.__all__``),
and one protocol across the result classes.

A new synonym of a canonical argument name, a second default or type for ``progress``, an
``n_random`` default without its reason, or a parameter after the model and the input that is not
keyword-only fails here; so does a result class whose ``top`` or ``layer`` differs from the
others'. Old spellings stay accepted for one minor version, with a DeprecationWarning
(``cw_lens.core.deprecation``).
"""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest

import cw_lens
from cw_lens.core.deprecation import keyword_only, renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.core.results import Result
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
    # what the model reads: a text, texts or token ids (a corpus analysis names it `corpus`)
    "inputs": ("text", "texts", "input", "prompt", "prompts", "tokens_or_text"),
    "max_tokens": ("n_tokens", "max_length", "max_len"),  # tokens kept per document
}
PROGRESS_DEFAULT = True
PROGRESS_TYPE = "bool"  # a bar or none; the bar's label is not an option
# n_random's default in each function that has one, and why it is that number (each function's
# docstring says "Default <n>" with the same reason)
N_RANDOM_DEFAULTS = {
    "selection_geometry": (16, "P2's protocol; a ranking is tensor work on the pass's values"),
    "prune_heads": (3, "P2's count; each order costs a corpus pass per retention level"),
    "faithfulness": (1, "P1's single draw; each extra one costs 24 passes per batch"),
    "rollout_deletion": (5, "each ranking costs len(ks) passes per batch of short items"),
    "input_deletion": (5, "a draw costs what a method's removals cost; five average the control"),
}
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
        assert sig.parameters["progress"].annotation in (PROGRESS_TYPE, bool), name
    if "kind" in sig.parameters:
        assert sig.parameters["kind"].default in KIND_VALUES, name


@pytest.mark.parametrize(("name", "sig"), FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_keyword_only_after_the_model_and_the_input(name, sig):
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p, v in sig.parameters.items() if v.kind in kinds]
    allowed = POSITIONAL.get(name, 2)
    assert len(positional) <= allowed, f"{name}: make {positional[allowed:]} keyword-only"


@pytest.mark.parametrize(("name", "sig"), FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_n_random_defaults_are_listed_with_their_reason(name, sig):
    if "n_random" not in sig.parameters:
        assert name not in N_RANDOM_DEFAULTS, name
        return
    assert name in N_RANDOM_DEFAULTS, f"{name}: add its n_random default and why to the table"
    default, _reason = N_RANDOM_DEFAULTS[name]
    assert sig.parameters["n_random"].default == default, name
    doc = inspect.getdoc(getattr(cw_lens, name)) or ""
    entry = re.search(r"^    n_random:(.*?)(?=^    \w+:|^\S|\Z)", doc, re.S | re.M)
    text = " ".join(entry.group(1).split()) if entry else ""
    assert f"Default {default}" in text, f"{name}: say 'Default {default}' and why: {text!r}"


# --------------------------------------------------------------------------- the result classes
def _subclasses(cls: type) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in {sub} | _subclasses(sub)}


RESULT_CLASSES = sorted(
    (c for c in _subclasses(Result) if c.__module__.startswith("cw_lens.")),
    key=lambda c: c.__name__,
)
# result classes without `top`, and why
NO_TOP = {
    "LayerContributionsResult": "one streamed block, valid only inside the consumer: reduce it",
    "LayerSharesResult": "one streamed block, valid only inside the consumer: reduce it",
}
# classes named *Result that are not public results, and why
NOT_RESULTS = {"NLLResult": "the NLL accumulator of corpus_nll; no public function returns it"}
TOP_K_DEFAULT = 10


def test_every_class_named_result_is_a_result():
    """Every `class ...Result` in cw_lens's source derives from Result (or is listed)."""
    root = Path(cw_lens.__file__).parent
    named = {
        m
        for path in root.rglob("*.py")
        for m in re.findall(r"^class (\w+Result)\b", path.read_text(encoding="utf-8"), re.M)
    }
    assert named - set(NOT_RESULTS) == {c.__name__ for c in RESULT_CLASSES}
    assert len(RESULT_CLASSES) >= 17


@pytest.mark.parametrize("cls", RESULT_CLASSES, ids=lambda c: c.__name__)
def test_top_has_one_signature(cls):
    """`top(k=10, *, ...)`: `k` first (positional or keyword, default 10), the rest keyword-only."""
    if cls.__name__ in NO_TOP:
        assert not hasattr(cls, "top"), f"{cls.__name__} has top(): take it out of NO_TOP"
        return
    assert hasattr(cls, "top"), f"{cls.__name__} has no top()"
    params = list(inspect.signature(cls.top).parameters.values())
    assert params[0].name == "self"
    k = params[1]
    assert (k.name, k.kind, k.default) == (
        "k",
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        TOP_K_DEFAULT,
    ), f"{cls.__name__}.top: first parameter {k}"
    late = [p.name for p in params[2:] if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert not late, f"{cls.__name__}.top: make {late} keyword-only"


@pytest.mark.parametrize("cls", RESULT_CLASSES, ids=lambda c: c.__name__)
def test_layer_returns_a_result_and_save_is_shared(cls):
    """`layer(n)` returns a result (the table: `.layer(n).to_dataframe()`); every result saves
    with the one `Result.save`."""
    returns = inspect.signature(cls.layer).return_annotation
    assert "DataFrame" not in str(returns), f"{cls.__name__}.layer returns {returns}"
    assert cls.save is Result.save, f"{cls.__name__} overrides save()"


def test_load_result_is_public():
    assert "load_result" in cw_lens.__all__
    assert list(inspect.signature(cw_lens.load_result).parameters) == ["path"]


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
        (cw_lens.routes, "text", "inputs"),
        (cw_lens.compare_sink_patch, "text", "inputs"),
        (cw_lens.lone_head_costs, "n_tokens", "max_tokens"),
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
    with pytest.warns(DeprecationWarning, match=r"routes\(text=...\) is now routes\(inputs=...\)"):
        old_name = cw_lens.routes(model, text="hello world")
    assert old_name.to_dataframe().equals(cw_lens.routes(model, "hello world").to_dataframe())


def test_old_positional_top_arguments_still_run():
    """`by`/`mode` after `k` were positional in some results: by position they still run, with
    a DeprecationWarning; `SinkPatchComparisonResult.top(n)` now reads `n` as `k`, and says so."""
    model = tiny_llama(seed=0, n_layers=2)
    texts = ["The quick brown fox jumps over the lazy dog.", "A second, different text."]
    stats = cw_lens.sink_statistics(model, texts, min_query=2, progress=False)
    with pytest.warns(DeprecationWarning, match=r"pass by=... by keyword"):
        old = stats.top(3, "output_norm")
    pd_equal = old.equals(stats.top(3, by="output_norm"))
    assert pd_equal and len(old) == 3
    comparison = cw_lens.compare_sink_patch(model, texts[0], view_layers=[1])
    with pytest.warns(FutureWarning, match="reads n as k"):
        assert len(comparison.top(2)) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert comparison.top(k=2, position=3)["rank"].tolist() == [1, 2]
