"""Which model classes this TransformerLens has: bridge (3.x, 4.x), HookedTransformer (2.x, 3.x)."""

from __future__ import annotations

import pytest

from cw_lens.core.errors import UnsupportedModelError
from cw_lens.models import hooked


def _available(get) -> bool:
    try:
        get()
    except UnsupportedModelError:
        return False
    return True


TL_VERSION = hooked.tl_version()
HAS_HOOKED = _available(hooked.hooked_transformer_class)
HAS_BRIDGE = _available(hooked.bridge_class)
APIS = [api for api, ok in (("bridge", HAS_BRIDGE), ("hooked", HAS_HOOKED)) if ok]

needs_hooked = pytest.mark.skipif(
    not HAS_HOOKED, reason=f"TransformerLens {TL_VERSION} has no HookedTransformer"
)
needs_bridge = pytest.mark.skipif(
    not HAS_BRIDGE, reason=f"TransformerLens {TL_VERSION} has no TransformerBridge"
)
needs_both = pytest.mark.skipif(
    not (HAS_HOOKED and HAS_BRIDGE),
    reason=f"TransformerLens {TL_VERSION} does not have both model classes",
)
