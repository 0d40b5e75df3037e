"""`python -m cw_lens.viz [out.html]`: write the tiny-model demo page of the token view."""

import sys

import cw_lens
from cw_lens.models.testing import tiny_llama


def demo(path: str = "cw_view_demo.html") -> str:
    """Write the tiny-model demo page to `path`."""
    cw = cw_lens.contribution_weights(tiny_llama(), "hello world,\n\tattention sinks", kind="inter")
    cw.to_html(path)
    return path


if __name__ == "__main__":
    print(demo(*sys.argv[1:2]))
