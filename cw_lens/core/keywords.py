"""A misspelt keyword argument names the right one: `sink_statistics(model, corpus, head=[0])`
raises "sink_statistics() got an unexpected keyword argument 'head'; did you mean 'heads'?".

[`check_keywords`][cw_lens.core.keywords.check_keywords] wraps a public function: a call whose
keywords are all the function's own (or the old spellings its `renamed_kwargs` still accepts) runs
the function unchanged — the check is one set comparison per call — and any other keyword raises
[`UnexpectedKeywordError`][cw_lens.core.errors.UnexpectedKeywordError] (an
[`InputError`][cw_lens.InputError] and a `TypeError`, as Python's own error is) before any work.
The hint is the closest real keyword (`difflib`), or the canonical name of a common synonym
(`verbose=` -> `progress=`, `text=` -> the function's input), or else the list of its keywords.
`functools.wraps` keeps the signature: `inspect.signature` and the API docs see the real one.

Example:

    @check_keywords
    def sink_statistics(model, corpus, *, heads=None, progress=True): ...

    sink_statistics(model, corpus, head=[0])  # UnexpectedKeywordError: ... did you mean 'heads'?
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from cw_lens.core.errors import UnexpectedKeywordError

F = TypeVar("F", bound=Callable[..., Any])

# what the function reads (its second parameter) is named one of these
INPUT_NAMES = ("inputs", "corpus")
# common synonyms -> the canonical keyword (suggested when the function takes it); "<input>" is
# the function's input parameter, whichever of INPUT_NAMES it is
SYNONYMS = {
    "text": "<input>",
    "texts": "<input>",
    "tokens": "<input>",
    "token_ids": "<input>",
    "input": "<input>",
    "input_ids": "<input>",
    "prompt": "<input>",
    "prompts": "<input>",
    "documents": "<input>",
    "docs": "<input>",
    "verbose": "progress",
    "show_progress": "progress",
    "pbar": "progress",
    "tqdm": "progress",
    "mask": "attention_mask",
    "random_state": "seed",
    "random_seed": "seed",
    "rng": "seed",
    "sinks": "sink_positions",
    "sink_pos": "sink_positions",
    "bs": "batch_size",
    "add_bos": "prepend_bos",
    "bos": "prepend_bos",
    "layer_list": "layers",
    "head_list": "heads",
    "n_draws": "n_random",
    "max_length": "max_tokens",
    "max_len": "max_tokens",
    "n_tokens": "max_tokens",
}
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def keyword_names(fn: Callable[..., Any]) -> tuple[set[str], set[str]]:
    """The keywords `fn` takes: its own parameters (what `inspect.signature` shows, through
    any `functools.wraps` wrappers) and the old spellings its `renamed_kwargs` still accept.

    Args:
        fn: The function (possibly wrapped).

    Returns:
        `(parameters, old_spellings)`.
    """
    params = {p.name for p in inspect.signature(fn).parameters.values() if p.kind in _KEYWORD_KINDS}
    old: set[str] = set()
    layer: Any = fn
    while layer is not None:  # every wrapper of the chain may hold its own renamed keywords
        old |= set(getattr(layer, "__renamed_kwargs__", {}))
        layer = getattr(layer, "__wrapped__", None)
    return params, old


def keyword_hint(name: str, given: str, params: Iterable[str]) -> str:
    """The message for keyword `given`, which function `name` does not take.

    Args:
        name: The function's name.
        given: The unexpected keyword.
        params: The keywords the function takes.

    Returns:
        "name() got an unexpected keyword argument 'given'; " and the closest real keyword,
        the canonical name of a common synonym, or the list of keywords.

    Examples:
        >>> keyword_hint("sink_statistics", "head", ["corpus", "heads", "layers"])
        "sink_statistics() got an unexpected keyword argument 'head'; did you mean 'heads'?"
        >>> keyword_hint("routes", "verbose", ["inputs", "target"])
        "routes() got an unexpected keyword argument 'verbose'; it takes inputs=, target=."
    """
    names = sorted(params)
    start = f"{name}() got an unexpected keyword argument {given!r}; "
    canonical = SYNONYMS.get(given)
    if canonical == "<input>":
        canonical = next((n for n in INPUT_NAMES if n in names), None)
    if canonical in names:
        return f"{start}did you mean {canonical!r}?"
    close = difflib.get_close_matches(given, names, n=1, cutoff=0.6)
    if close:
        return f"{start}did you mean {close[0]!r}?"
    return f"{start}it takes {', '.join(f'{n}=' for n in names)}."


def check_keywords(fn: F | None = None, *, also: Callable[..., Any] | Iterable[str] = ()) -> Any:
    """Raise [`UnexpectedKeywordError`][cw_lens.core.errors.UnexpectedKeywordError], naming the
    closest real keyword, when `fn` is called with a keyword it does not take.

    Valid calls run `fn` unchanged; the wrapper keeps `fn`'s name, docstring and signature
    (`functools.wraps`). Use it bare (`@check_keywords`) or with `also=` for a function whose
    `**kwargs` it passes on.

    Args:
        fn: The function (when used bare, `@check_keywords`).
        also: For a function with `**kwargs`: the callable those go to (its keyword-only
            parameters are accepted too) or their names. Without it, such a function is
            returned as is.

    Returns:
        The wrapped function, or with `fn=None` the decorator.

    Examples:
        >>> @check_keywords
        ... def f(model, corpus, *, heads=None):
        ...     return heads
        >>> f(None, None, heads=3)
        3
        >>> try:
        ...     f(None, None, head=3)
        ... except TypeError as error:
        ...     print(error)
        f() got an unexpected keyword argument 'head'; did you mean 'heads'?
    """

    def decorate(fn: F) -> F:
        params, old = keyword_names(fn)
        var_keyword = any(
            p.kind is inspect.Parameter.VAR_KEYWORD
            for p in inspect.signature(fn).parameters.values()
        )
        if var_keyword:
            if callable(also):  # its keyword-only parameters: what **kwargs may carry
                extra = inspect.signature(also).parameters.values()
                params = params | {p.name for p in extra if p.kind is p.KEYWORD_ONLY}
            elif also:
                params = params | set(also)
            else:
                return fn  # anything may go on to **kwargs: nothing to check
        allowed = frozenset(params | old)
        suggest = frozenset(params)
        name = fn.__name__

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if kwargs and not allowed.issuperset(kwargs):
                given = next(k for k in kwargs if k not in allowed)
                raise UnexpectedKeywordError(keyword_hint(name, given, suggest))
            return fn(*args, **kwargs)

        wrapper.__checked_keywords__ = allowed  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate if fn is None else decorate(fn)
