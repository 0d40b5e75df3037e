"""Deprecations of the public API: old spellings keep working for one minor version, with a
`DeprecationWarning` that names the new one.

- `renamed_kwargs` — a function's keyword argument renamed (`n_draws=` -> `n_random=`);
- `keyword_only` — arguments that were positional and are now keyword-only;
- `deprecated` — any other old behaviour kept reachable: warn, then do it;
- `moved_to_reproduction` — a result method that moved to `cw_lens.reproduction` (the
  papers' claims, replicates and intervals), kept on the result for one minor version.

Example:

    @renamed_kwargs(n_draws="n_random")
    def prune_heads(model, corpus, *, n_random=3): ...

    prune_heads(model, corpus, n_draws=5)    # DeprecationWarning; runs with n_random=5
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from cw_lens.core.errors import InputError

F = TypeVar("F", bound=Callable[..., Any])

# Every old spelling still here goes in 0.5: those deprecated in 0.4.0, and those of 0.3.0,
# which 0.4.0 shipped while its warnings said "removed in 0.4" (the promise moved rather than
# broken in a patch release: code that silenced those warnings gets a release's notice).
REMOVED_IN = "0.5"


def deprecated(message: str, *, stacklevel: int = 3, removed_in: str = REMOVED_IN) -> None:
    """Warn that an old spelling or behaviour goes away in `removed_in`.

    Args:
        message: What is deprecated and what replaces it.
        stacklevel: The frame the warning points at (the caller of the deprecated call).
        removed_in: The version that removes it.
    """
    warnings.warn(
        f"{message} (deprecated; removed in cw_lens {removed_in})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_kwargs(**old_to_new: str) -> Callable[[F], F]:
    """Accept each old keyword name for its new one, with a `DeprecationWarning`; passing
    both raises [`InputError`][cw_lens.InputError]. The wrapped function's signature shows only the
    new names; `__renamed_kwargs__` lists the old ones."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise InputError(
                        f"{fn.__name__}() got both {old}= and {new}=; pass only {new}= "
                        f"({old}= is its deprecated name)."
                    )
                deprecated(f"{fn.__name__}({old}=...) is now {fn.__name__}({new}=...)")
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        wrapper.__renamed_kwargs__ = dict(old_to_new)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def keyword_only(*names: str) -> Callable[[F], F]:
    """Accept `names` (now keyword-only, in this order after the positional parameters) also
    positionally, with a `DeprecationWarning`: `routes(model, text, 5)` runs as
    `routes(model, text, target=5)`."""

    def decorate(fn: F) -> F:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        n_positional = sum(p.kind in kinds for p in inspect.signature(fn).parameters.values())

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            extra = args[n_positional:]
            if extra:
                if len(extra) > len(names):
                    raise TypeError(
                        f"{fn.__name__}() takes {n_positional} positional arguments; pass the "
                        f"others by keyword"
                    )
                given = dict(zip(names, extra, strict=False))
                spelled = ", ".join(f"{name}=..." for name in given)
                deprecated(f"{fn.__name__}(): pass {spelled} by keyword")
                kwargs.update(given)
            return fn(*args[:n_positional], **kwargs)

        wrapper.__keyword_only__ = names  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


# The result methods that moved to the reproduction layer in 0.5 go in 0.6.
REPRODUCTION_METHODS_REMOVED_IN = "0.6"


def moved_to_reproduction(
    name: str, old_parameters: tuple[str, ...] | None = None
) -> Callable[..., Any]:
    """A result method `name` (`claims`, `replicates` or `intervals`) that is now the function
    `cw_lens.reproduction.<name>(result, ...)`: it warns, then calls that function.

    The toolkit never imports the reproduction layer (the import contract in pyproject.toml);
    this forward looks the function up by name when a deprecated method is called, and goes
    with the methods in `REPRODUCTION_METHODS_REMOVED_IN`.

    Args:
        name: The method's name, which is also the function's.
        old_parameters: The method's parameters in their old order, where the function takes
            them in another: positional arguments bind to these names and go on by keyword
            (`PruningResult.claims(other_scope, bootstrap)`).

    Returns:
        The method to set in the result class's body.
    """

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        deprecated(
            f"{type(self).__name__}.{name}() is now cw_lens.reproduction.{name}(result, ...)",
            removed_in=REPRODUCTION_METHODS_REMOVED_IN,
        )
        if old_parameters is not None:
            if len(args) > len(old_parameters):
                raise TypeError(
                    f"{type(self).__name__}.{name}() takes at most {len(old_parameters)} "
                    "positional arguments"
                )
            for parameter, value in zip(old_parameters, args, strict=False):
                if parameter in kwargs:
                    raise TypeError(
                        f"{type(self).__name__}.{name}() got multiple values for {parameter!r}"
                    )
                kwargs[parameter] = value
            args = ()
        import importlib

        function = getattr(importlib.import_module("cw_lens.reproduction"), name)
        return function(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = (
        f"Deprecated: `cw_lens.reproduction.{name}(result, ...)` (removed in cw_lens "
        f"{REPRODUCTION_METHODS_REMOVED_IN})."
    )
    method.__moved_to__ = f"cw_lens.reproduction.{name}"  # type: ignore[attr-defined]
    return method


def moved_attributes(package: str, moved: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for names that moved to another module in 0.5 (the papers' claim
    helpers, now in `cw_lens.reproduction`): it warns, then returns the name from its new home,
    found by name when asked for (as `moved_to_reproduction` does).

    Args:
        package: The module whose `__getattr__` this is (for the messages).
        moved: `{name: its new module}`.

    Returns:
        The module's `__getattr__`.
    """

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        deprecated(
            f"{package}.{name} is now {target}.{name}",
            removed_in=REPRODUCTION_METHODS_REMOVED_IN,
        )
        import importlib
        import sys

        value = getattr(importlib.import_module(target), name)
        vars(sys.modules[package])[name] = value  # warned once: `from x import y` asks twice
        return value

    return __getattr__
