"""Models: everything that touches a model.

Loading (and the GGUF cache of the embedded model), the HookedTransformer/TransformerBridge
builders, the access protocol, capture of one forward pass layer by layer, the per-layer
contribution math on what capture yields, verification, weight processing, edits and
interventions, and the tiny test models. Layer 2 of 5 (see `docs/architecture.md`): imports
only `cw_lens.core`. The names below are the old module `cw_lens.models` (now
`cw_lens.models.load`), so `from cw_lens.models import load_model` keeps working.
"""

from typing import Any

from cw_lens.models import load
from cw_lens.models.load import (
    EMBEDDED_DISTRIBUTION,
    EMBEDDED_HF_ID,
    EMBEDDED_NAME,
    EMBEDDED_PIP,
    embedded_gguf_path,
    embedded_tokenizer,
    gguf_cache_dir,
    load_gguf_hf,
    load_model,
    model_name,
)

__all__ = [
    "EMBEDDED_DISTRIBUTION",
    "EMBEDDED_HF_ID",
    "EMBEDDED_NAME",
    "EMBEDDED_PIP",
    "embedded_gguf_path",
    "embedded_tokenizer",
    "gguf_cache_dir",
    "load_gguf_hf",
    "load_model",
    "model_name",
]


def __getattr__(name: str) -> Any:
    """Anything else the old module `cw_lens.models` held comes from its new home."""
    try:
        return getattr(load, name)
    except AttributeError:
        raise AttributeError(f"module 'cw_lens.models' has no attribute {name!r}") from None
