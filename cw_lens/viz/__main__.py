"""``python -m cw_lens.viz [out.html]``: write the tiny-model demo page of the token view."""

import sys

from cw_lens.viz.view import demo

print(demo(*sys.argv[1:2]))
