r"""The plain data the front end (`view.js`) draws: JSON-ready dicts, every number made here.

The front end draws what it is given and computes nothing: aggregates over heads, relative
norms, NLL and cone changes are all in the payload. One schema serves the saved page and the
live widget:

- `tokens` / `labels` (`token_label`), `n`, `model`, `kind`, `layers` (the
  model layers whose maps are present), `heads`, `init` (layer, head, query);
- `clean`: a **run** (below); `patch`: `None` (a plain
  [`ContributionResult`][cw_lens.ContributionResult] page) or `{"options", "controls", "runs"}` —
  `options` says which controls are free (widget) or which values were precomputed (page: `ranges`,
  `scales`, `modes`), and `runs` maps `"range,scale,mode"` indices to a patched run (at `lambda =
  1`, which leaves the model unchanged: its maps are all `None`).

A **run** is `maps` (per layer in `layers`: `{"h": [per head {"a", "r", "c", "w", "on"}],
"all": {"a", "w"}}` — attention, relative norm, cosine, contribution weight over the causal
triangle, row-major, query `i`, key `j <= i` at `i (i + 1) / 2 + j`, and the output norm
per query; `all` is the mean attention and the sum (inter) or mean (intra) of the weights over
the heads on the page; a map is `None` in a patched run when it is identical to the clean one
— layers before the first patched layer, and every layer at `lambda = 1`), `top` (the
top-k next tokens and probabilities per position), `nll` (per position), `nll_mean`,
`ppl`, and in a patched run `cone` (per patched layer and head: mean output norm and cone
alignment), `delta` (patched - clean: NLL per position and mean, norm and cone per head)
and its `controls`. Values are rounded to 4 significant digits;
undefined ones (zero output norm) are `null`.
"""

from __future__ import annotations

import json
import math
import numbers
import unicodedata
from typing import Any

import numpy as np
from torch import Tensor

from cw_lens.core.errors import InputError

SIG_DIGITS = 4
#: Head value that selects the aggregate over heads (sum for inter, mean for intra).
ALL_HEADS = "all"
_ALL_ALIASES = ("all", "sum", "mean")
_WHITESPACE = {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}


def token_label(token: str) -> str:
    """The visible form of a token string: whitespace and control characters as symbols.

    Space `·`, newline `↵`, tab `→`, carriage return `␍`, other control characters
    their Unicode control picture (`␀`...`␟`, `␡`), other invisible characters (no-break
    and exotic spaces, zero-width and format characters) `⍽`; an empty token is `∅`.
    """
    if token == "":
        return "∅"
    out = []
    for ch in token:
        code = ord(ch)
        if ch in _WHITESPACE:
            out.append(_WHITESPACE[ch])
        elif code < 32:
            out.append(chr(0x2400 + code))
        elif code == 127:
            out.append("␡")
        elif unicodedata.category(ch) in ("Zs", "Zl", "Zp", "Cf", "Cc"):
            out.append("⍽")
        else:
            out.append(ch)
    return "".join(out)


def round_sig(values: Any, digits: int = SIG_DIGITS) -> np.ndarray:
    """Round to `digits` significant digits (float64; NaN and inf unchanged).

    Vectorised; the result equals `float(f"{x:.{digits}g}")`, so `json` writes the short
    decimal form.
    """
    x = np.asarray(values, dtype=np.float64)
    out = x.copy()
    ok = np.isfinite(x) & (x != 0)
    v = x[ok]
    k = (digits - 1 - np.floor(np.log10(np.abs(v)))).astype(np.int64)
    scale = 10.0 ** np.abs(k)
    up = k >= 0
    r = np.empty_like(v)
    r[up] = np.round(v[up] * scale[up]) / scale[up]
    r[~up] = np.round(v[~up] / scale[~up]) * scale[~up]
    out[ok] = r
    return out


def json_list(values: Any, digits: int = SIG_DIGITS) -> list:
    """Rounded values as a JSON-ready (nested) list; NaN and inf become `None`."""
    if isinstance(values, Tensor):
        values = values.detach().cpu().double().numpy()
    r = round_sig(values, digits)
    bad = ~np.isfinite(r)
    if not bad.any():
        return r.tolist()
    obj = r.astype(object)
    obj[bad] = None
    return obj.tolist()


def json_number(value: float) -> float | None:
    v = float(value)
    return float(round_sig(v)) if math.isfinite(v) else None


def script_json(data: dict) -> str:
    """JSON safe inside `<script>`: no `<`, `>`, `&` in the text; NaN refused."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def select(requested: Any, available: list[int], what: str) -> list[int]:
    """`requested` indices (one, several or `None` = all), each checked against
    `available`; sorted and unique."""
    if requested is None:
        return list(available)
    items = [requested] if isinstance(requested, numbers.Integral) else list(requested)
    missing = [int(i) for i in items if i not in available]
    if missing or not items:
        raise InputError(
            f"{what} {missing or items} not in this result ({what.lower()} {available}); "
            f"pick from those, or compute the result with them."
        )
    return sorted({int(i) for i in items})


def real_length(result: Any, batch: int) -> int:
    """The number of real tokens of `batch` (they are positions `0 .. n - 1`)."""
    n_batch = int(result.tokens.shape[0])
    if not 0 <= batch < n_batch:
        raise InputError(f"batch must be in 0..{n_batch - 1}, got {batch}.")
    mask = result.mask[batch].detach().cpu().numpy().astype(bool)
    n = int(mask.sum())
    if n == 0 or not mask[:n].all():
        raise InputError(f"Batch row {batch} has no real tokens at positions 0..{n - 1}.")
    return n


def layer_maps(result: Any, batch: int, layers: list[int], heads: list[int]) -> list[dict]:
    """Per layer of `layers`: every head's fields over the causal triangle, and the
    aggregate over `heads` (see the module docstring)."""
    n = real_length(result, batch)
    rows, cols = np.tril_indices(n)
    li = [result.layers.index(v) for v in layers]
    hi = [result.heads.index(v) for v in heads]
    sel = np.ix_(li, hi)

    def pairwise(t: Tensor) -> np.ndarray:  # [layer, head, n(n+1)/2], float64
        return t[batch].detach().cpu().double().numpy()[sel][..., :n, :n][..., rows, cols]

    fields = ("attention", "relative_norm", "cosine", "weights")
    a, r, c, w = (pairwise(getattr(result, f)) for f in fields)
    on = result.output_norm[batch].detach().cpu().double().numpy()[sel][..., :n]
    # the aggregate: a token's share of the layer output (inter: a sum) or the mean of the
    # per-head shares (intra); undefined where any head's weight is
    agg_w = w.sum(1) if result.kind == "inter" else w.mean(1)
    out = []
    for i in range(len(layers)):
        per_head = [
            {
                "a": json_list(a[i, j]),
                "r": json_list(r[i, j]),
                "c": json_list(c[i, j]),
                "w": json_list(w[i, j]),
                "on": json_list(on[i, j], SIG_DIGITS + 2),
            }
            for j in range(len(heads))
        ]
        out.append({"h": per_head, "all": {"a": json_list(a[i].mean(0)), "w": json_list(agg_w[i])}})
    return out


def map_bytes(n: int, n_layers: int, n_heads: int) -> float:
    """Rough JSON size of the maps of one run (about 8 bytes a value)."""
    tri = n * (n + 1) // 2
    return 8.0 * n_layers * (n_heads * (4 * tri + n) + 2 * tri)


def page_header(result: Any, batch: int, layers: list[int], heads: list[int]) -> dict:
    """The static part of a payload: tokens, labels, the layers and heads on the page."""
    n = real_length(result, batch)
    str_tokens = list(result.str_tokens[batch])[:n]
    bos = bool(result.prepend_bos) and (
        result.bos_token is None or str_tokens[0] == result.bos_token
    )
    return {
        "version": 2,
        "model": str(result.model_name or ""),
        "kind": str(result.kind),
        "batch": batch,
        "n": n,
        "tokens": str_tokens,
        "labels": [token_label(t) for t in str_tokens],
        "layers": layers,
        "heads": heads,
        "all_heads": list(result.heads),
        "bos": bos,
    }


def initial_state(
    layers: list[int], heads: list[int], n: int, layer: Any, head: Any, query: Any
) -> dict:
    """Checked initial (layer, head, query); `head` may be `"all"`."""
    layer = layers[0] if layer is None else int(layer)
    if layer not in layers:
        raise InputError(f"layer {layer} is not among the layers on the page ({layers}).")
    if head is None:
        head = heads[0]
    elif isinstance(head, str):
        if head not in _ALL_ALIASES:
            raise InputError(f"head must be a head index or 'all', got {head!r}.")
        head = ALL_HEADS
    elif int(head) not in heads:
        raise InputError(f"head {head} is not among the heads on the page ({heads}).")
    else:
        head = int(head)
    query = n - 1 if query is None else int(query)
    if not 0 <= query < n:
        raise InputError(f"query must be a real position 0..{n - 1}, got {query}.")
    return {"layer": layer, "head": head, "query": query}


def run_payload(run: Any, layers: list[int], strings: dict[int, str]) -> dict:
    """A `SinkRun` as a run (maps of `layers`, all
    heads)."""
    heads = list(run.weights.heads)
    ids = run.top_ids.tolist()
    return {
        "maps": layer_maps(run.weights, 0, layers, heads),
        "top": {
            "tok": [[token_label(strings[i]) for i in row] for row in ids],
            "p": json_list(run.top_probs),
        },
        "nll": json_list(run.nll),
        "nll_mean": json_number(run.mean_nll),
        "ppl": json_number(math.exp(run.mean_nll)),
        "cone": None,
    }


def patched_payload(cmp: Any, layers: list[int]) -> dict:
    """The patched run of a [`SinkPatchComparisonResult`][cw_lens.SinkPatchComparisonResult], with
    its changes from the clean run and `None` maps for the layers the patch cannot reach (before its
    first)."""
    out = run_payload(cmp.patched, layers, cmp.token_strings)
    c = cmp.controls
    # lambda = 1 leaves the model exactly as it is (patch_sink subtracts 0 x the sink term)
    first = math.inf if (c.mode == "scale" and c.scale == 1.0) else c.layers[0]
    maps = zip(layers, out["maps"], strict=True)
    out["maps"] = [None if layer < first else m for layer, m in maps]
    run = cmp.patched
    out["cone"] = {
        "layers": run.cone_layers,
        "norm": json_list(run.norm),
        "cone": json_list(run.cone),
    }
    ci = [cmp.clean.cone_layers.index(layer) for layer in cmp.patched.cone_layers]
    out["delta"] = {
        "nll": json_list(cmp.patched.nll - cmp.clean.nll),
        "nll_mean": json_number(cmp.delta_nll),
        "norm": json_list(cmp.patched.norm - cmp.clean.norm[ci]),
        "cone": json_list(cmp.patched.cone - cmp.clean.cone[ci]),
        "clean_norm": json_list(cmp.clean.norm[ci]),
        "clean_cone": json_list(cmp.clean.cone[ci]),
    }
    out["controls"] = cmp.controls.to_dict()
    return out
