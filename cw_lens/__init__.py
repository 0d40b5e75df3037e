"""cw_lens — contribution weights and attention-sink geometry for TransformerLens models.

Public API (re-exports only; each function's module docstring states its formula and paper):

- models: :func:`load_model`
- data: :func:`load_corpus`, :class:`Corpus`, :class:`Document`
- contributions (P1): :func:`contribution_weights`, :func:`contribution_weights_from_cache`,
  :func:`stream_contributions`, :class:`ContributionResult`, :class:`LayerContributions`
"""

from cw_lens.contributions import (
    ContributionResult,
    LayerContributions,
    contribution_weights,
    contribution_weights_from_cache,
    stream_contributions,
)
from cw_lens.data import Corpus, Document, load_corpus
from cw_lens.errors import (
    CwLensError,
    EmbeddedModelMissing,
    InputError,
    ModelLoadError,
    UnsupportedModelError,
)
from cw_lens.models import load_model

__version__ = "0.1.0"

__all__ = [
    "ContributionResult",
    "Corpus",
    "CwLensError",
    "Document",
    "EmbeddedModelMissing",
    "InputError",
    "LayerContributions",
    "ModelLoadError",
    "UnsupportedModelError",
    "contribution_weights",
    "contribution_weights_from_cache",
    "load_corpus",
    "load_model",
    "stream_contributions",
]
