r"""From (model, text, controls) to the data the front end draws — the widget's and the page's.

Two producers of the payload of `cw_lens.viz.payload` that run the model:

- `patch_state` — one state of the live widget: the clean run (maps of the viewed layer)
  and the run with the sink patched as `controls` say
  ([`cw_lens.compare_sink_patch`][cw_lens.compare_sink_patch]: `patch_sink` + `contribution_weights`
  + the model's logits, in one pass). A pure function of its arguments; the widget calls it on every
  control change, passing back the clean run.
- `sink_patch_data` / `sink_patch_html` — the saved page: the clean run and a
  precomputed sweep (`lambda` in {0, 0.25, 0.5, 0.75, 1} x a few layer ranges x modes).

Example:

    import cw_lens
    from cw_lens.interactive.view_state import patch_state, sink_patch_html

    model = cw_lens.load_model()
    state = patch_state(model, "The capital of France is", {"layers": [10, 19], "scale": 0.0},
                        layer=20)
    state["patched"]["top"]["tok"][-1]          # the patched model's top-5 after "is"
    sink_patch_html(model, "The capital of France is Paris.", path="patch.html")
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from cw_lens.core.errors import InputError
from cw_lens.data.inputs import prepare_inputs
from cw_lens.interactive.comparison import (
    PatchControls,
    SinkRun,
    compare_sink_patch,
    run_text,
    token_strings,
)
from cw_lens.interactive.resume import CleanStream
from cw_lens.models.access import resolve_layers
from cw_lens.viz.payload import initial_state, page_header, patched_payload, run_payload
from cw_lens.viz.view import DEFAULT_MAX_MB, check_size, render_page, write

#: The `lambda` values of the saved page's sweep (1 is the clean model).
SWEEP_SCALES = (0.0, 0.25, 0.5, 0.75, 1.0)
MODES = ("scale", "norm_matched")


def default_ranges(n_layers: int) -> list[tuple[int, int]]:
    """Thirds of the model (first, middle, last) and the whole model, without repeats."""
    blocks = [b for b in np.array_split(np.arange(n_layers), 3) if len(b)]
    ranges = [(int(b[0]), int(b[-1])) for b in blocks] + [(0, n_layers - 1)]
    return list(dict.fromkeys(ranges))


def default_view_layers(n_layers: int, k: int = 4) -> list[int]:
    """`k` layers spread over the model (all of them when there are few)."""
    if n_layers <= k:
        return list(range(n_layers))
    return sorted({int(np.rint(x)) for x in np.linspace(0, n_layers - 1, k + 2)[1:-1]})


def clean_run(
    model: Any,
    text: str,
    *,
    sinks: Sequence[int] = (0,),
    kind: str = "intra",
    top_k: int = 5,
    stream: CleanStream | None = None,
) -> SinkRun:
    """The clean run of `text` with every layer's maps and cone measures (what the widget
    computes once per text and sink positions).

    Args:
        model: The model.
        text: The one text.
        sinks: The sink positions (for the cone measures).
        kind: `"intra"` or `"inter"` contribution weights.
        top_k: How many next tokens to keep per position.
        stream: An empty [`CleanStream`][cw_lens.interactive.resume.CleanStream]: it records
            the residual stream of the same pass, from which patched passes resume.

    Returns:
        The clean [`SinkRun`][cw_lens.interactive.comparison.SinkRun].
    """
    batch = prepare_inputs(model, text)
    all_layers = list(range(model.cfg.n_layers))
    with nullcontext() if stream is None else stream.recording(model, batch.tokens):
        return run_text(
            model,
            batch,
            layers=all_layers,
            cone_layers=all_layers,
            sinks=sinks,
            kind=kind,
            top_k=top_k,
        )


def _quiet(fn: Any, *args: Any, **kw: Any) -> Any:
    """Run `fn` with the zero-norm-row warnings off (the payload marks those rows null)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*numerically zero", category=RuntimeWarning)
        return fn(*args, **kw)


def patch_state(
    model: Any,
    text: str,
    controls: dict | PatchControls,
    *,
    layer: int,
    head: int | str | None = None,
    query: int | None = None,
    kind: str = "intra",
    top_k: int = 5,
    clean: SinkRun | None = None,
    stream: CleanStream | None = None,
    with_data: bool = True,
) -> dict:
    """The widget's state for `controls`: `{"data": ..., "patched": ...}`.

    `data` is the static part and the clean run with the maps of `layer` (every head);
    `patched` the run with the sink patched, with its changes from the clean run.

    Args:
        model: The model.
        text: The one text.
        controls: The patch (`PatchControls` or its JSON form).
        layer: The viewed layer.
        head: The initial head (`None`: the first; `"all"`).
        query: The initial query (`None`: the last position).
        kind: `"intra"` or `"inter"` contribution weights.
        top_k: How many next tokens to keep per position.
        clean: The clean run (from `clean_run`): skips the clean pass.
        stream: The clean pass's residual stream (recorded with `clean`): the patched pass
            starts at the first patched layer.
        with_data: Build `data`; `False` gives `None` there (the widget resends `data` only
            when the viewed layer or the sinks change).

    Returns:
        `{"data": ..., "patched": ...}`, plain JSON-ready data.
    """
    if not isinstance(controls, PatchControls):
        controls = PatchControls.from_dict(model, dict(controls))
    (layer,) = resolve_layers(model, [layer])
    cmp = _quiet(
        compare_sink_patch,
        model,
        text,
        layers=controls.layers,
        heads=None if controls.heads is None else list(controls.heads),
        scale=controls.scale,
        mode=controls.mode,
        sink_positions=controls.sinks,
        view_layers=[layer],
        kind=kind,
        top_k=top_k,
        clean=clean,
        stream=stream,
    )
    if not with_data:
        return {"data": None, "patched": patched_payload(cmp, [layer])}
    heads = list(cmp.clean.weights.heads)
    data = page_header(cmp.clean.weights, 0, [layer], heads)
    data["choices"] = list(range(model.cfg.n_layers))
    data["init"] = initial_state([layer], heads, data["n"], layer, head, query)
    data["clean"] = run_payload(cmp.clean, [layer], cmp.token_strings)
    data["patch"] = {
        "options": {
            "free": True,
            "n_layers": model.cfg.n_layers,
            "n_heads": model.cfg.n_heads,
            "max_scale": 2.0,
            "modes": list(MODES),
        },
        "controls": controls.to_dict(),
    }
    return {"data": data, "patched": patched_payload(cmp, [layer])}


def sink_patch_data(
    model: Any,
    text: str,
    *,
    layers: Sequence[int] | None = None,
    ranges: Sequence[tuple[int, int]] | None = None,
    scales: Sequence[float] = SWEEP_SCALES,
    modes: Sequence[str] = ("scale",),
    sink_positions: Sequence[int] = (0,),
    kind: str = "intra",
    top_k: int = 5,
    layer: int | None = None,
    head: int | str | None = None,
    query: int | None = None,
    max_mb: float = DEFAULT_MAX_MB,
) -> dict:
    """The payload of a saved sink-patching page: the clean run and the precomputed sweep.

    Args:
        layers: Layers whose maps the page shows (default `default_view_layers`).
        ranges: Layer ranges `(first, last)` to patch (default `default_ranges`).
        scales: The `lambda` values of the sweep (in [0, 2]).
        modes: `"scale"` and/or `"norm_matched"` (norm-matched ignores `scales`: one run
            per range).
        sink_positions, kind, top_k: As in
        [`cw_lens.compare_sink_patch`][cw_lens.compare_sink_patch]. layer, head, query: The initial
        view.
        max_mb: Refuse a page whose maps would exceed this many MB.
    """
    # Long: the clean run, the sweep of patched runs and the payload, in the order the page reads
    # them.
    n_layers = model.cfg.n_layers
    view = resolve_layers(model, default_view_layers(n_layers) if layers is None else layers)
    range_list = default_ranges(n_layers) if ranges is None else [tuple(r) for r in ranges]
    if not modes or len(set(modes)) != len(modes) or not set(modes) <= set(MODES):
        raise InputError(f"modes must be distinct, from {MODES}, got {modes!r}.")
    if not scales or len(set(scales)) != len(scales):
        raise InputError(f"scales must be distinct values in [0, 2], got {scales!r}.")
    controls = {
        (ri, si, mi): PatchControls.of(
            model, layers=r, scale=scale, mode=mode, sink_positions=sink_positions
        )
        for ri, r in enumerate(range_list)
        for mi, mode in enumerate(modes)
        for si, scale in enumerate(scales if mode == "scale" else scales[:1])
    }
    patched_layers = sorted({layer for c in controls.values() for layer in c.layer_list})
    batch = prepare_inputs(model, text)
    n_runs = 1 + sum(c.scale != 1.0 or c.mode != "scale" for c in controls.values())
    n = batch.tokens.shape[1]
    check_size(n, len(view), model.cfg.n_heads, n_runs, max_mb, "fewer layers=[...] or ranges")
    kw = dict(sinks=sink_positions, kind=kind, top_k=top_k)
    stream = CleanStream()  # the sweep's patched passes resume from the clean pass's stream
    with stream.recording(model, batch.tokens):
        clean = _quiet(run_text, model, batch, layers=view, cone_layers=patched_layers, **kw)
    runs: dict[str, Any] = {}
    for (ri, si, mi), c in controls.items():
        cmp = _quiet(
            compare_sink_patch,
            model,
            text,
            layers=c.layers,
            scale=c.scale,
            mode=c.mode,
            sink_positions=sink_positions,
            view_layers=view,
            clean=clean,
            stream=stream,
            **{k: v for k, v in kw.items() if k != "sinks"},
        )
        runs[f"{ri},{si},{mi}"] = patched_payload(cmp, view)
    heads = list(clean.weights.heads)
    data = page_header(clean.weights, 0, view, heads)
    data["choices"] = view
    data["init"] = initial_state(view, heads, data["n"], layer, head, query)
    data["clean"] = run_payload(clean, view, token_strings(model, clean.top_ids))
    data["patch"] = {
        "options": {
            "free": False,
            "n_layers": n_layers,
            "n_heads": model.cfg.n_heads,
            "ranges": [list(r) for r in range_list],
            "scales": [float(s) for s in scales],
            "modes": list(modes),
        },
        "controls": next(iter(controls.values())).to_dict(),
        "runs": runs,
    }
    return data


def sink_patch_html(
    model: Any, text: str, *, path: Any = None, title: str | None = None, **kwargs: Any
) -> str:
    """The saved, self-contained sink-patching page (`sink_patch_data`); written to
    `path` when given. Opens from a `file://` URL; needs no kernel and no network."""
    return write(render_page(sink_patch_data(model, text, **kwargs), title), path)
