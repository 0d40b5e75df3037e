"""One input vocabulary: every public analysis reads the same kinds of input, refuses the same
others with the same message, and hints at the right name of a misspelt keyword.

The table is every public callable of ``cw_lens.__all__`` whose input (its second parameter) is
``inputs`` or ``corpus`` (a new entry point without a row fails here) x every kind of input: a
text, texts, a 1-D and a 2-D token tensor, a list of token ids, a list of token-id lists, a
``Corpus`` and a list of ``Document``. Each kind runs (tiny Llama, 8-token documents) and gives
bit for bit the numbers of the same tokens given as text; each unreadable kind (a float tensor,
floats, a dict, None, an empty text or list, ids outside the vocabulary) raises the one
``InputError`` message every entry point shares.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

import cw_lens
from cw_lens.core.errors import InputError, UnexpectedKeywordError
from cw_lens.data.documents import ACCEPTED_INPUTS, Corpus, Document
from cw_lens.data.inputs import prepare_inputs
from cw_lens.models.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

# entry points whose module has not taken `@check_keywords` yet: their keyword-hint rows are
# expected to fail (empty this set as the decorator lands; strict xfail says when one has)
KEYWORDS_PENDING: set[str] = set()
# entry points whose **kwargs go on to another library, which names a wrong keyword itself
KEYWORDS_OPEN = {"load_model": "**boot_kwargs go to TransformerBridge.boot_transformers"}
HAS_WIDGET = importlib.util.find_spec("anywidget") is not None
INPUT_NAMES = ("inputs", "corpus")
TEXTS = ("The cat", "A dog s")  # 7 bytes each: 8 tokens with BOS (the byte tokenizer)


@dataclass(frozen=True)
class Row:
    """How the table calls one entry point: its options (tiny sizes, no bar), whether it reads
    one text, and whether it needs IOI items (texts and token ids are refused, with a reason)."""

    options: dict[str, Any] = field(default_factory=dict)
    one_text: bool = False
    ioi: bool = False


QUIET = {"progress": False}
ROWS = {
    "attention_rollout": Row(),
    "compare_sink_patch": Row({"view_layers": [1]}, one_text=True),
    "contribution_rollout": Row(),
    "contribution_weights": Row(),
    "corpus_analyses": Row(
        {
            "analyses": {
                "sinks": {"min_query": 2},
                "selection": {"n_random": 1, "n_grid": [2]},
                "taxonomy": {},
                "ablation": {},
            },
            **QUIET,
        }
    ),
    "detect_sinks": Row({"min_later": 2}),
    "faithfulness": Row(
        {
            "metrics": ("attention",),
            "fractions": (0.5,),
            "modes": ("comprehensiveness",),
            **QUIET,
        }
    ),
    "head_taxonomy": Row(QUIET),
    "input_deletion": Row(
        {
            "methods": ("contribution_rollout",),
            "fractions": (0.5,),
            "n_random": 1,
            "normalise": False,
            **QUIET,
        }
    ),
    "ioi_route_statistics": Row(ioi=True),
    "lone_head_costs": Row({"heads": [(0, 0), (1, 3)], **QUIET}),
    "prune_heads": Row(
        {"order": ("magnitude",), "retention": (0.5,), "lone": False, "cross_fit": False, **QUIET}
    ),
    "residual_shares": Row(),
    "rollout_deletion": Row({"ks": (1,), "n_random": 1}),
    "routes": Row(one_text=True),
    "selection_geometry": Row({"n_random": 1, "n_grid": [2], **QUIET}),
    "sink_ablation": Row(QUIET),
    "sink_patcher": Row(one_text=True),
    "sink_rates": Row(),
    "sink_statistics": Row({"min_query": 2, **QUIET}),
    "stream_contributions": Row(QUIET),
    "stream_shares": Row(QUIET),
}


def _public_functions() -> list[str]:
    names = []
    for name in sorted(cw_lens.__all__):
        if name == "sink_patcher" and not HAS_WIDGET:
            names.append(name)  # the optional widget extra: known to take `inputs`
            continue
        if inspect.isfunction(getattr(cw_lens, name)):
            names.append(name)
    return names


def _takes_inputs(name: str) -> bool:
    if name == "sink_patcher" and not HAS_WIDGET:
        return True
    return list(inspect.signature(getattr(cw_lens, name)).parameters)[1:2] in (
        [n] for n in INPUT_NAMES
    )


PUBLIC = _public_functions()
ENTRY_POINTS = [name for name in PUBLIC if _takes_inputs(name)]


def _entry(name: str) -> Any:
    if name == "sink_patcher" and not HAS_WIDGET:
        pytest.skip("the widget extra (anywidget) is not installed")
    return getattr(cw_lens, name)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, n_layers=2)


@pytest.fixture(scope="module")
def ioi(model):
    return cw_lens.load_corpus("ioi", n_docs=2, model=model)


# --------------------------------------------------------------------------- the kinds
def _ids(model: Any, n: int) -> list[list[int]]:
    """The token ids (BOS first) of the first `n` texts, as the text path tokenises them."""
    return prepare_inputs(model, list(TEXTS[:n])).tokens.tolist()


# each kind of input, made from `n` documents (kinds that hold one document ignore `n`)
KINDS = {
    "text": lambda model, n: TEXTS[0],
    "texts": lambda model, n: list(TEXTS[:n]),
    "tensor_1d": lambda model, n: torch.tensor(_ids(model, 1)[0]),
    "tensor_2d": lambda model, n: torch.tensor(_ids(model, n)),
    "array_2d": lambda model, n: np.array(_ids(model, n)),
    "id_list": lambda model, n: _ids(model, 1)[0],
    "id_lists": lambda model, n: _ids(model, n),
    "corpus": lambda model, n: Corpus("two", [Document(t) for t in TEXTS[:n]]),
    "documents": lambda model, n: [Document(t) for t in TEXTS[:n]],
}
ONE_DOCUMENT = {"text", "tensor_1d", "id_list"}
TOKEN_KINDS = {"tensor_1d", "tensor_2d", "array_2d", "id_list", "id_lists"}


def _expected(what: str) -> str:
    return f"Expected {ACCEPTED_INPUTS}; got {what}."


# each unreadable input and the one message every entry point gives for it
BAD = {
    "float_tensor": (
        lambda: torch.zeros(2, 8),
        _expected("a tensor of dtype torch.float32 (token ids are integers)"),
    ),
    "bool_tensor": (
        lambda: torch.ones(8, dtype=torch.bool),
        _expected("a tensor of dtype torch.bool (token ids are integers)"),
    ),
    "floats": (lambda: [1.0, 2.0], _expected("a list containing float")),
    "nested_floats": (lambda: [[1.0, 2.0], [3, 4]], _expected("a list containing list of float")),
    "text_and_int": (lambda: ["a text", 3], _expected("a list containing int")),
    "dict": (lambda: {"text": TEXTS[0]}, _expected("a dict")),
    "none": (lambda: None, _expected("None")),
    "bytes": (lambda: TEXTS[0].encode(), _expected("a bytes object (decode it to a str)")),
    "empty_string": (lambda: "", "The input text is empty: there is no token to analyse."),
    "empty_list": (lambda: [], "The corpus is empty: pass at least one document."),
    "empty_id_list": (lambda: [[]], "Document 0 of the corpus is empty (no token ids)."),
    "empty_tensor": (
        lambda: torch.zeros(1, 0, dtype=torch.long),
        "The token tensor is empty: there is no token to analyse.",
    ),
    "ids_out_of_vocab": (
        lambda: [[256, 97, 1000]],
        "Token ids must lie in [0, 259) for this model; got ids from 97 to 1000. Were they made "
        "with another tokenizer?",
    ),
}


# --------------------------------------------------------------------------- running a row
def _call(name: str, model: Any, inputs: Any) -> Any:
    """Run entry point `name` on `inputs` with its row's options; returns its numbers."""
    fn = _entry(name)
    options = dict(ROWS[name].options)
    recorded: list[float] = []
    if name == "stream_contributions":
        options["consumer"] = lambda lc: recorded.append(lc.weights("intra").nansum().item())
    if name == "stream_shares":
        options["consumer"] = lambda block: recorded.append(block.residual.sum().item())
    result = fn(model, inputs, **options)
    return recorded if "consumer" in options else _numbers(result)


def _numbers(value: Any) -> Any:
    """What a result holds, as tensors, frames and plain values to compare."""
    if isinstance(value, tuple | list):
        return type(value)(_numbers(v) for v in value)
    if isinstance(value, torch.Tensor | pd.DataFrame | int | float | str) or value is None:
        return value
    if isinstance(value, Mapping):
        return {k: _numbers(v) for k, v in value.items()}
    if type(value).__name__ == "SinkPatcher":
        return json.dumps([value.data, value.patched], sort_keys=True, default=str)
    return value.to_dataframe()


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=where or "DataFrame")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where or None)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, tuple | list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and np.isnan(a):
        assert isinstance(b, float) and np.isnan(b), where
    else:
        assert a == b, where


_REFERENCES: dict[tuple[str, int], Any] = {}


def _reference(name: str, model: Any, n: int) -> Any:
    """The numbers of the first `n` texts given as strings, computed once per entry point."""
    if (name, n) not in _REFERENCES:
        _REFERENCES[name, n] = _call(name, model, list(TEXTS[:n]))
    return _REFERENCES[name, n]


# --------------------------------------------------------------------------- the table
def test_the_table_covers_every_entry_point_that_reads_inputs():
    assert set(ENTRY_POINTS) == set(ROWS), (
        f"give every public analysis a row: missing {sorted(set(ENTRY_POINTS) - set(ROWS))}, "
        f"no longer public {sorted(set(ROWS) - set(ENTRY_POINTS))}"
    )
    assert len(ENTRY_POINTS) >= 21


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_kind_runs_and_gives_the_numbers_of_its_text(model, ioi, name, kind):
    row = ROWS[name]
    n = 1 if row.one_text or kind in ONE_DOCUMENT else 2
    if row.ioi:  # IOI items carry their answer and names: texts and token ids cannot
        if kind in ("corpus", "documents"):
            items = ioi if kind == "corpus" else list(ioi)
            _assert_same(_call(name, model, items), _call(name, model, ioi))
            return
        with pytest.raises(InputError, match=r"needs IOI items.*load_corpus\('ioi'"):
            _call(name, model, KINDS[kind](model, n))
        return
    got = _call(name, model, KINDS[kind](model, n))
    _assert_same(got, _reference(name, model, n), f"{name}({kind})")


@pytest.mark.parametrize("kind", ["texts", "tensor_2d", "id_lists", "corpus"])
@pytest.mark.parametrize("name", sorted(n for n, row in ROWS.items() if row.one_text))
def test_one_text_entry_points_refuse_two_documents_with_a_reason(model, name, kind):
    with pytest.raises(InputError, match="one text"):
        _call(name, model, KINDS[kind](model, 2))


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_unreadable_inputs_get_one_message(model, name, bad):
    make, message = BAD[bad]
    if ROWS[name].ioi and bad == "ids_out_of_vocab":
        message = None  # refused first for being token ids, not IOI items
    with pytest.raises(InputError) as caught:
        _call(name, model, make())
    if message is None:
        assert "needs IOI items" in str(caught.value)
    else:
        assert str(caught.value) == message


# --------------------------------------------------------------------------- the coercion
def test_ragged_token_id_lists_read_as_their_texts(model):
    """Rows of different lengths need no padding: the numbers are those of the texts."""
    texts = ["The cat sat", "A dog"]
    ids = [prepare_inputs(model, t).tokens[0].tolist() for t in texts]
    for fn in (cw_lens.contribution_weights, cw_lens.sink_rates):
        _assert_same(_numbers(fn(model, ids)), _numbers(fn(model, texts)), fn.__name__)
    padded = prepare_inputs(model, texts)
    masked = cw_lens.contribution_weights(model, padded.tokens, attention_mask=padded.mask)
    _assert_same(_numbers(masked), _numbers(cw_lens.contribution_weights(model, ids)))


def test_token_ids_are_read_as_given(model):
    """No BOS is prepended to token ids (prepend_bos is for text); the batch says whether
    their rows start with BOS."""
    bos = model.tokenizer.bos_token_id
    without = prepare_inputs(model, [[97, 98, 99]], prepend_bos=True)
    assert without.tokens.tolist() == [[97, 98, 99]] and not without.prepend_bos
    with_bos = prepare_inputs(model, [bos, 97, 98])
    assert with_bos.tokens.tolist() == [[bos, 97, 98]] and with_bos.prepend_bos


def test_padding_inside_token_ids_needs_a_mask(model):
    pad = model.tokenizer.pad_token_id
    with pytest.raises(InputError, match=r"pad tokens .* no attention_mask"):
        prepare_inputs(model, [[256, 97, pad]])
    with pytest.raises(InputError, match="only accepted with a token-id tensor"):
        prepare_inputs(model, [[256, 97, 98]], attention_mask=torch.ones(1, 3))


# --------------------------------------------------------------------------- misspelt keywords
def _misspelt(name: str) -> tuple[str, str]:
    """A keyword of `name` and a misspelling of it no function parameter has: the last letter
    dropped (or an `s` added), as `head=` for `heads=`."""
    params = inspect.signature(_entry(name)).parameters
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p for p, v in params.items() if v.kind in kinds and p != "model"]
    names.sort(key=lambda p: params[p].kind is not inspect.Parameter.KEYWORD_ONLY)
    for right in names:
        wrong = right[:-1] if len(right) > 3 else right + "s"
        if wrong not in params:
            return right, wrong
    raise AssertionError(f"{name}: no keyword to misspell")


def _keyword_rows() -> list[Any]:
    return [
        pytest.param(
            name,
            marks=pytest.mark.xfail(strict=True, reason="decorator pending", raises=AssertionError)
            if name in KEYWORDS_PENDING
            else (),
        )
        for name in PUBLIC
        if name not in KEYWORDS_OPEN
    ]


@pytest.mark.parametrize("name", _keyword_rows())
def test_a_misspelt_keyword_names_the_right_one(name):
    fn = _entry(name)
    right, wrong = _misspelt(name)
    try:
        fn(**{wrong: 1})  # raised before the call binds its arguments: nothing runs
    except UnexpectedKeywordError as error:
        message = str(error)
    except TypeError as error:  # Python's own: no hint
        message = str(error)
    assert message == (
        f"{name}() got an unexpected keyword argument {wrong!r}; did you mean {right!r}?"
    )


def test_keyword_errors_are_input_and_type_errors(model):
    with pytest.raises(TypeError, match=r"did you mean 'layers'\?") as caught:
        cw_lens.sink_rates(model, TEXTS[0], layer=[0])
    assert isinstance(caught.value, InputError)
    with pytest.raises(InputError, match=r"routes\(\) .* 'verbose'; it takes inputs=, .*target="):
        cw_lens.routes(model, TEXTS[0], verbose=True)
    with pytest.raises(InputError, match=r"'text'; did you mean 'corpus'\?"):
        cw_lens.head_taxonomy(model, text=TEXTS[0])


def test_the_decorator_keeps_signatures_and_old_spellings(model):
    for name in PUBLIC:
        fn = _entry(name)
        if name in KEYWORDS_PENDING:
            continue
        assert not any(
            p.kind is inspect.Parameter.VAR_POSITIONAL
            for p in inspect.signature(fn).parameters.values()
        ), name
    assert cw_lens.routes.__renamed_kwargs__ == {"text": "inputs"}
    with pytest.warns(DeprecationWarning, match=r"routes\(text=...\)"):
        cw_lens.routes(model, text=TEXTS[0])
    with pytest.warns(DeprecationWarning, match="n_tokens"):
        cw_lens.lone_head_costs(model, TEXTS[0], heads=[(0, 0)], n_tokens=4, progress=False)
