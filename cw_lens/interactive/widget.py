r"""The live sink-patching widget for Jupyter (anywidget): patch the sink, watch what changes.

`cw_lens.sink_patcher(model, text)` shows P1's Fig. 1 (attention next to contribution for one
layer, head and query, the factors on hover, the head grid) and the sink-norm ablation of
methods § Attention sinks (docs/methods.md#sinks) ([`cw_lens.patch_sink`][cw_lens.patch_sink]:
`pv_0^h -> lambda pv_0^h`) with live controls — the layer range, heads (all or a subset), `lambda`
in [0, 2], the mode (`scale` / `norm_matched`) and the sink position(s). On every change the kernel
re-runs the model with the patch — one pass that starts at the first patched layer from the clean
pass's residual stream (`cw_lens.interactive.resume`; bit-equal to the full patched pass, which
runs instead where resuming cannot be vouched for: `last_pass` says which), the clean pass being
computed once per text and sink positions — and the front end shows, clean next to patched: the
top-k next-token probabilities, the per-token NLL change, the chosen head's attention and
contribution matrices, and the per-head output norms and cone alignment of the patched layers.

The numbers come from `cw_lens.interactive.view_state.patch_state` (plain data); the front
end is the
same ES module as the saved page (`view.js`), so `patcher.to_html("page.html")` writes a
self-contained page with a precomputed sweep that works without a kernel. Works wherever
anywidget does: JupyterLab, Notebook 7, VS Code, Colab.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

try:
    import anywidget
    import traitlets
except ImportError as err:  # pragma: no cover - the optional extra is missing
    raise ImportError(
        "The live widget needs anywidget: pip install 'cw_lens[widget]' (anywidget, ipywidgets)."
    ) from err

from cw_lens.core.deprecation import renamed_kwargs
from cw_lens.core.errors import CwLensError, InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import one_text
from cw_lens.interactive.comparison import PatchControls, SinkRun
from cw_lens.interactive.resume import CleanStream
from cw_lens.interactive.view_state import clean_run, patch_state, sink_patch_html
from cw_lens.models.access import Model, resolve_layers


def _asset(name: str) -> str:
    return resources.files("cw_lens.viz").joinpath(name).read_text(encoding="utf-8")


class SinkPatcher(anywidget.AnyWidget):
    """The widget (see the module docstring). Synced state: `data` (static part and the clean
    run of the viewed layer), `patched` (the patched run), `controls` (what the front end
    sets), `view` (`{"layer": L}`) and `status` (an error message, or empty)."""

    _esm = _asset("view.js")
    _css = _asset("view.css")
    data = traitlets.Dict().tag(sync=True)
    patched = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    controls = traitlets.Dict().tag(sync=True)
    view = traitlets.Dict().tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)

    def __init__(
        self,
        model: Any,
        text: str,
        *,
        layers: Any = None,
        heads: Any = None,
        scale: float = 0.0,
        mode: str = "scale",
        sink_positions: Any = (0,),
        layer: int | None = None,
        head: int | str | None = None,
        query: int | None = None,
        kind: str = "intra",
        top_k: int = 5,
    ) -> None:
        super().__init__()
        self._model, self._text, self._kind, self._top_k = model, text, kind, top_k
        controls = PatchControls.of(
            model, layers=layers, heads=heads, scale=scale, mode=mode, sink_positions=sink_positions
        )
        layer = controls.layers[1] if layer is None else resolve_layers(model, [layer])[0]
        self._stream = CleanStream()  # the clean pass's residual stream: patched passes resume
        self._clean: SinkRun = clean_run(
            model, text, sinks=controls.sinks, kind=kind, top_k=top_k, stream=self._stream
        )
        state = self._state(controls, layer, head, query)
        with self.hold_sync():
            self.data, self.patched = state["data"], state["patched"]
            self.controls, self.view = controls.to_dict(), {"layer": layer}
        self._data_key = (layer, controls.sinks)
        self.observe(self._changed, names=["controls", "view"])

    def _state(
        self,
        controls: PatchControls,
        layer: int,
        head: Any = None,
        query: Any = None,
        with_data: bool = True,
    ) -> dict:
        if controls.sinks != self._clean.sinks:
            self._clean = clean_run(
                self._model,
                self._text,
                sinks=controls.sinks,
                kind=self._kind,
                top_k=self._top_k,
                stream=self._stream,
            )
        return patch_state(
            self._model,
            self._text,
            controls,
            layer=layer,
            head=head,
            query=query,
            kind=self._kind,
            top_k=self._top_k,
            clean=self._clean,
            stream=self._stream,
            with_data=with_data,
        )

    @property
    def last_pass(self) -> str:
        """What the last patched pass did: `"resumed at layer L"` (it started at the first
        patched layer, from the clean pass's residual stream) or `"full pass: <why>"`."""
        return self._stream.note

    def _changed(self, _: Any = None) -> None:
        """Re-run the model for the current controls and view; errors go to `status`."""
        try:
            controls = PatchControls.from_dict(self._model, self.controls)
            layer = int(self.view.get("layer", controls.layers[1]))
            key = (layer, controls.sinks)  # the clean maps shown change with these alone
            state = self._state(controls, layer, with_data=key != self._data_key)
        except (CwLensError, TypeError, ValueError) as err:
            self.status = f"{type(err).__name__}: {err}"
            return
        with self.hold_sync():
            if state["data"] is not None:
                self.data, self._data_key = state["data"], key
            self.patched = state["patched"]
            self.status = ""

    def update(self, **controls: Any) -> SinkPatcher:
        """Change controls from Python (`layers=(a, b)`, `heads`, `scale`, `mode`,
        `sinks`) or the viewed `layer`; the widget re-runs as if the front end had."""
        layer = controls.pop("layer", None)
        unknown = set(controls) - {"layers", "heads", "scale", "mode", "sinks"}
        if unknown:
            raise InputError(f"Unknown controls {sorted(unknown)}.")
        new = {**self.controls, **controls}
        if "layers" in controls:
            new["layers"] = list(controls["layers"])
        PatchControls.from_dict(self._model, new)  # raise here, not in the status line
        self.unobserve(self._changed, names=["controls", "view"])
        try:
            self.controls = new
            if layer is not None:
                self.view = {"layer": resolve_layers(self._model, [layer])[0]}
        finally:
            self.observe(self._changed, names=["controls", "view"])
        self._changed()
        return self

    def to_html(self, path: Any = None, **kwargs: Any) -> str:
        """The saved page of this text with a precomputed sweep (`sink_patch_html`)."""
        kwargs.setdefault("sink_positions", tuple(self.controls.get("sinks", (0,))))
        return sink_patch_html(
            self._model, self._text, path=path, kind=self._kind, top_k=self._top_k, **kwargs
        )


@check_keywords(also=SinkPatcher.__init__)
@renamed_kwargs(text="inputs")
def sink_patcher(model: Model, inputs: str, **kwargs: Any) -> SinkPatcher:
    """The live sink-patching widget; arguments as `SinkPatcher` (`inputs`: its one text;
    `text=` is the deprecated name).

    Args:
        model: A TransformerLens model.
        inputs: The one text (BOS is prepended: position 0 is the default sink), or its token
            ids (`[pos]`, `[1, pos]`, a list of ids: read as given).
        **kwargs: The controls and the view of `cw_lens.interactive.widget.SinkPatcher`:
            `layers`, `heads`, `scale`, `mode`, `sink_positions`, `layer`, `head`, `query`, `kind`,
            `top_k`, ...

    Returns:
        A `SinkPatcher` widget (anywidget): the last expression of a Jupyter cell displays it.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        # needs the widget extra: pip install "cw_lens[widget]"
        widget = cw_lens.sink_patcher(model, "The cat sat on the mat.")
        ```
    """
    one_text("sink_patcher", len(as_corpus(inputs)))
    return SinkPatcher(model, inputs, **kwargs)
