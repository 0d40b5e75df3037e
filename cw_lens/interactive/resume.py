r"""The patched pass resumed at the first patched layer, from the clean pass's residual stream.

The sink patch ([`cw_lens.patch_sink`][cw_lens.patch_sink]) changes nothing before its first
layer `L`: blocks `0 .. L-1` of a patched pass compute exactly what they computed in the clean
pass. So the widget's clean pass keeps what every block returned (`CleanStream`, recorded by hooks
in that same pass, once per text), and each patched pass replays blocks `0 .. L-1` from it instead
of running them:

- block `L` receives the stream the clean pass sent into it (`blocks.L.hook_resid_pre` fires on
  that tensor, as in a full pass);
- everything the model computes outside its blocks runs as in any pass — the embedding, the
  attention masks, the positions and rotary tables each block is handed, the final norm and the
  unembedding — so nothing computed before block 0 is taken from the cache;
- the viewed layer's contribution weights, the cone measures of the patched layers and the
  logits all come from that one resumed pass; a viewed layer before `L` (where the patch cannot
  reach) takes its weights from the clean run, which are the numbers a full patched pass
  computes there.

The resumed pass is bit-equal to the full patched pass (`tests/test_widget_resume.py`: logits and
every number the widget shows, with `torch.equal`). Where that cannot be vouched for, the full
pass runs and `CleanStream.note` (the widget's `last_pass`) says why, with a `RuntimeWarning`
once per reason:

- the patch starts at layer 0, or no stream was recorded for this text and model;
- the model is in training mode (dropout), or an intervention is entered on it;
- a hook other than TransformerLens's own sits in a skipped block (or in any block when the
  clean pass ran, or a global module hook): its effects or side effects would be skipped;
- the model's parameters changed since the clean pass (a version counter or a storage moved);
- the blocks do not chain — a block's input is not the tensor the previous block returned, so
  the model computes something between blocks — or a block returns more than tensors;
- the model fails the self-check run once per model: passes resumed at the middle and at the
  last layer must reproduce the clean pass's block outputs exactly (a model whose blocks share
  state beyond the residual stream, such as a KV cache one layer reads from another, fails it).

Parallel blocks (GPT-J, NeoX, Cohere) resume like sequential ones: a block's output is still the
stream the next block reads, and the self-check holds them to the same exactness.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from cw_lens.analyses.contributions import ContributionResult
from cw_lens.models.access import LayerWeights, StreamDone, model_access

# the self-check's verdict per model (None: resuming reproduces the clean pass exactly)
_SELF_CHECK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _replayable(output: Any) -> bool:
    """A block output that can be replayed: a tensor, or a tuple/list of tensors and `None`."""
    if isinstance(output, Tensor):
        return True
    return isinstance(output, tuple | list) and all(
        o is None or isinstance(o, Tensor) for o in output
    )


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, tuple | list) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def _copy(output: Any) -> Any:
    """A copy of a block output (fresh tensors: a later block may write into its input)."""
    if isinstance(output, Tensor):
        return output.clone()
    return type(output)(None if o is None else o.clone() for o in output)


def _foreign_hooks(blocks: Sequence[torch.nn.Module]) -> int:
    """Forward (pre-)hooks on `blocks` or inside them, TransformerLens's own wiring excepted
    (the bridge's capture hooks on its norms), plus PyTorch's global module hooks."""
    from torch.nn.modules import module as torch_module

    count = len(torch_module._global_forward_hooks) + len(torch_module._global_forward_pre_hooks)
    for block in blocks:
        own = {handle.id for handle in getattr(block, "_capture_hook_handles", ())}
        for m in block.modules():
            count += sum(k not in own for k in m._forward_hooks)
            count += sum(k not in own for k in m._forward_pre_hooks)
    return count


def _parameters(model: Any) -> list[tuple[dict, str, Tensor, int, int]]:
    """Every parameter with its slot (the owning module's `_parameters` dict and name), where
    its data lives and how often it was written in place."""
    found, seen = [], set()
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append((module._parameters, name, p, p.data_ptr(), p._version))
    return found


def _parameters_changed(recorded: list[tuple[dict, str, Tensor, int, int]]) -> bool:
    """Whether a recorded parameter was replaced in its slot, moved (`p.data = ...`) or
    written in place (`p.mul_(0)` under `no_grad`, `load_state_dict`). Not seen: a write
    through `p.data`, which PyTorch does not count, and a submodule replaced whole."""
    return not all(
        slots.get(name) is p and p.data_ptr() == ptr and p._version == version
        for slots, name, p, ptr, version in recorded
    )


@contextmanager
def _replaying(blocks: Sequence[torch.nn.Module], outputs: Sequence[Any]) -> Iterator[None]:
    """Within: block `k` returns a copy of `outputs[k]` instead of running (any forward set
    on the instance, such as an offload wrapper, is put back after)."""
    saved = []
    try:
        for block, output in zip(blocks, outputs, strict=True):
            saved.append((block, block.__dict__.get("forward")))
            block.__dict__["forward"] = lambda *_, output=output, **__: _copy(output)
        yield
    finally:
        for block, forward in saved:
            if forward is None:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = forward


class CleanStream:
    """The clean pass's block outputs for one text (what each block returned, so the stream
    entering block `L` is `outputs[L - 1]`), with what a resumed pass checks against.

    Not a result: it lives beside the widget's clean `SinkRun` and is never saved. Fill it with
    `clean_run(model, text, stream=CleanStream())`; pass it to
    [`compare_sink_patch`][cw_lens.compare_sink_patch] (`stream=`) to resume patched passes.
    It also keeps each layer's `W_O` and Gram matrices between passes (`weights`), dropped when
    the parameters change.

    Attributes:
        outputs: Per block, its output in the clean pass (copies).
        tokens: The token ids of the text.
        refusal: Why this stream cannot be resumed from (`None` when it can).
        note: What the last patched pass did: `"resumed at layer L"` or `"full pass: ..."`.
        weights: Layer weights kept across passes (`cw_lens.models.access.LayerWeights`).
    """

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.tokens: Tensor | None = None
        self.refusal: str | None = "no clean pass was recorded"
        self.note = ""
        self.weights: dict[int, LayerWeights] = {}
        self._model: Any = None
        self._params: list[tuple[dict, str, Tensor, int, int]] = []
        self._warned: set[str] = set()

    @contextmanager
    def recording(self, model: Any, tokens: Tensor) -> Iterator[CleanStream]:
        """Record the block outputs of the (clean) pass run within.

        Args:
            model: The model.
            tokens: The token ids `[1, pos]` of the pass.

        Yields:
            This stream (filled when the context ends).
        """
        access = model_access(model)
        blocks = list(model.blocks)
        same = self._model is not None and self._model() is model
        if not same or _parameters_changed(self._params):
            self.weights = {}  # kept layer weights stay valid while the parameters do
        self._model, self._params = weakref.ref(model), _parameters(model)
        self.tokens, self.outputs = tokens.detach().clone(), []
        self.refusal = _model_refusal(model, access, blocks)
        if self.refusal is not None:
            with access.weights_kept(self.weights):
                yield self
            return
        outputs: dict[int, Any] = {}
        broken: list[str] = []

        def before(k: int, args: tuple, kwargs: dict) -> None:
            entering = _first_tensor(args) if args else kwargs.get("hidden_states")
            if k > 0 and (k - 1 not in outputs or entering is not last[0]):
                broken.append(f"block {k}'s input is not the output of block {k - 1}")

        def after(k: int, output: Any) -> None:
            if not _replayable(output):
                broken.append(f"block {k} returns {type(output).__name__}, not tensors")
                return
            outputs[k], last[0] = _copy(output), _first_tensor(output)

        last: list[Any] = [None]
        handles = []
        for k, block in enumerate(blocks):
            handles.append(
                block.register_forward_pre_hook(
                    lambda _m, a, kw, k=k: before(k, a, kw), with_kwargs=True
                )
            )
            handles.append(block.register_forward_hook(lambda _m, _a, out, k=k: after(k, out)))
        try:
            with access.weights_kept(self.weights):
                yield self
        finally:
            for handle in handles:
                handle.remove()
        if broken or len(outputs) != len(blocks):
            self.refusal = "the blocks do not chain: " + (broken or ["not every block ran"])[0]
            return
        self.outputs = [outputs[k] for k in range(len(blocks))]
        self.refusal = self_check(model, self)

    def why_not(self, model: Any, tokens: Tensor, first: int) -> str | None:
        """Why a patched pass of `tokens` cannot resume at layer `first`, or `None`.

        Args:
            model: The model.
            tokens: The token ids of the patched pass.
            first: The first patched layer.

        Returns:
            The reason, or `None` when the pass can resume there.
        """
        if first == 0:
            return "the patch starts at layer 0"
        if self.refusal is not None:
            return self.refusal
        if self._model is None or self._model() is not model:
            return "the clean stream was recorded on another model"
        if self.tokens is None or not torch.equal(self.tokens, tokens.to(self.tokens.device)):
            return "the clean stream was recorded on another text"
        if _parameters_changed(self._params):
            return "the model's parameters changed since the clean pass"
        access = model_access(model)
        return _model_refusal(model, access, list(model.blocks)[:first])

    def plan(self, model: Any, batch: Any, first: int, view: Sequence[int]) -> ResumePlan:
        """The patched pass for a patch whose first layer is `first`, keeping the weights of
        the layers `view`: resumed there, or the full pass with the reason.

        Args:
            model: The model.
            batch: The `TokenBatch` of the patched pass (one text).
            first: The first patched layer.
            view: The layers whose contribution weights the pass must give.

        Returns:
            A [`ResumePlan`][cw_lens.interactive.resume.ResumePlan].
        """
        why = self.why_not(model, batch.tokens, first)
        # the kept layer weights serve the model they were read from, while its parameters hold
        if self._model is None or self._model() is not model or _parameters_changed(self._params):
            self.weights.clear()
            kept = None
        else:
            kept = self
        if why is None:
            self.note = f"resumed at layer {first}"
            late = [layer for layer in view if layer >= first]
            return ResumePlan(list(view), late or [first], first, self)
        self.note = f"full pass: {why}"
        if why not in self._warned and first > 0:
            self._warned.add(why)
            warnings.warn(
                f"The patched pass runs in full (it cannot resume at layer {first}): {why}.",
                RuntimeWarning,
                stacklevel=3,
            )
        return ResumePlan(list(view), list(view), 0, kept)


def _model_refusal(model: Any, access: Any, blocks: Sequence[torch.nn.Module]) -> str | None:
    """What about the model's state rules out replaying `blocks` (or recording them)."""
    if model.training:
        return "the model is in training mode (dropout is random)"
    if access.active_edits:
        return "an intervention is entered on the model"
    if _foreign_hooks(blocks):
        return "hooks sit in the blocks a resumed pass would skip"
    return None


def self_check(model: Any, stream: CleanStream) -> str | None:
    """Once per model: do passes resumed at the middle and the last layer give exactly the
    block outputs of the clean pass recorded in `stream`? (Each pass stops after the last
    block.)

    Args:
        model: The model.
        stream: A stream just recorded (no refusal).

    Returns:
        `None` when they do, else why resuming is refused on this model.
    """
    if model in _SELF_CHECK:
        return _SELF_CHECK[model]
    access = model_access(model)
    blocks = list(model.blocks)
    n = len(blocks)
    verdict = None
    for first in sorted({n // 2, n - 1} - {0}):
        got: dict[int, Any] = {}

        def keep(k: int, output: Any, got: dict = got) -> None:
            got[k] = _first_tensor(output)
            if k == n - 1:
                raise StreamDone

        handles = [
            blocks[k].register_forward_hook(lambda _m, _a, out, k=k: keep(k, out))
            for k in range(first, n)
        ]
        try:
            with torch.inference_mode(), _replaying(blocks[:first], stream.outputs[:first]):
                access.forward(stream.tokens.to(access.device))
        except StreamDone:
            pass
        finally:
            for handle in handles:
                handle.remove()
        same = all(
            k in got and torch.equal(got[k], _first_tensor(stream.outputs[k]))
            for k in range(first, n)
        )
        if not same:
            verdict = (
                f"a pass resumed at layer {first} does not reproduce the clean pass on "
                f"{access.architecture} (its blocks share state beyond the residual stream)"
            )
            break
    _SELF_CHECK[model] = verdict
    return verdict


@dataclass
class ResumePlan:
    """One patched pass: where it starts (`first`, 0 for the full pass), the layers whose
    weights it captures (`layers`: the viewed ones from `first` on, or `first` alone), and how
    the viewed layers' weights are put together (`weights`)."""

    view: list[int]
    layers: list[int]
    first: int
    stream: CleanStream | None = field(default=None, repr=False)

    def context(self, model: Any) -> Any:
        """The context the pass runs in: blocks before `first` replayed, layer weights kept.

        Args:
            model: The model.

        Returns:
            A context manager.
        """
        if self.stream is None:
            return nullcontext()
        stack = ExitStack()
        stack.enter_context(model_access(model).weights_kept(self.stream.weights))
        if self.first > 0:
            blocks = list(model.blocks)[: self.first]
            stack.enter_context(_replaying(blocks, self.stream.outputs[: self.first]))
        return stack

    def weights(self, clean: ContributionResult, run: ContributionResult) -> ContributionResult:
        """The viewed layers' weights: from the pass from `first` on, from the clean run
        before it (the patch cannot reach there: those are the numbers a full pass gives).

        Args:
            clean: The clean run's weights (every viewed layer before `first`).
            run: The pass's weights (`layers`).

        Returns:
            A [`ContributionResult`][cw_lens.ContributionResult] over `view`.
        """
        if self.layers == self.view:
            return run
        parts = [(clean, layer) if layer < self.first else (run, layer) for layer in self.view]
        fields = {}
        for name, _ in ContributionResult._layer_axes:
            fields[name] = torch.cat(
                [getattr(r, name)[:, r.layers.index(layer)][:, None] for r, layer in parts], 1
            )
        # the zero-norm rows of the layers taken from the clean run (NaN `output_norm` at a
        # real query), which the full pass would have counted too
        mask = clean.mask[:, None, :].to(clean.output_norm.device)
        extra = sum(
            int((clean.output_norm[:, clean.layers.index(layer)].isnan() & mask).sum())
            for r, layer in parts
            if r is clean
        )
        return ContributionResult(
            **fields,
            tokens=run.tokens,
            mask=run.mask,
            str_tokens=run.str_tokens,
            layers=list(self.view),
            heads=run.heads,
            kind=run.kind,
            prepend_bos=run.prepend_bos,
            bos_token=run.bos_token,
            n_nan_rows=run.n_nan_rows + extra,
            model_name=run.model_name,
        )
