"""The probe pass of [`verify_model`][cw_lens.verify_model]: every check while its layer is in.

A layer-streamed model de-quantises a decoder layer when the forward pass reaches it, and an
offloaded one copies it in, so every pass over such a model costs a sweep of its weights.
Verification therefore reads everything it checks in one probe pass, at each layer while that
layer is in:

- the clean capture: `hook_pattern`, `hook_v`, `hook_z`, the outputs of the output projection
  and of the attention module, `W_O`/`b_O` and the weight facts, and the order the hooks fire in;
- the interventions: at the checked layer (`n_layers // 2`) the attention module is run again,
  from its own forward hook, on copies of the inputs it was just given, once under each
  intervention, with the pass's own hooks on that module held back meanwhile. An edit of that
  layer leaves every earlier layer as it is, so a pass of its own up to the layer would hand the
  module the same inputs; the re-run reads the intervened output without that pass;
- the flow analyses' block checks: [`run_blocks`][cw_lens.models.blocks.run_blocks] drives the
  pass, with the hooks above entered as an intervention is;
- on a bridge whose weights move (layer-streamed or offloaded), the unbridged Hugging Face
  forward: it runs in a second thread that takes turns with the pass one decoder layer at a
  time ([`Lockstep`][cw_lens.models.verify_probe.Lockstep]), so a layer brought in for the one
  is still in for the other.

A layer-streamed model is thus verified with one de-quantisation of each decoder layer.
`verify_model` falls back on passes of their own for what the probe pass could not settle: the
checks other than the flow analyses' when those refuse the model (their exception ends the pass),
and the interventions when a later layer's hook order changes the route they act on.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cw_lens.core.errors import UnsupportedModelError
from cw_lens.models.access import ATTENTION_HOOKS, ModelAccess
from cw_lens.models.batch import TokenBatch
from cw_lens.models.blocks import run_blocks
from cw_lens.models.edits import HeadRemoval, PairMask, SinkPatch, head_removal_hooks, realise
from cw_lens.models.offload import is_offloaded

INTERVENTIONS = ("patch_sink", "mask_attention", "remove_heads")


def first(output: Any) -> Tensor:
    """The tensor of a module output.

    Args:
        output: What a module returned.

    Returns:
        `output[0]` of a tuple or list, else `output`.
    """
    return output[0] if isinstance(output, (tuple, list)) else output


# ------------------------------------------------------------------ the unbridged HF model


def _unbridge(hf_model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Swap every TransformerLens bridge component inside `hf_model` for its original module;
    returns the swaps, for `_rebridge`."""
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []

    def walk(module: torch.nn.Module) -> None:
        for name, child in list(module._modules.items()):
            original = getattr(child, "original_component", None)
            if (
                isinstance(original, torch.nn.Module)
                and "transformer_lens" in type(child).__module__
            ):
                swaps.append((module, name, child))
                module._modules[name] = original
                walk(original)
            elif child is not None:
                walk(child)

    try:
        walk(hf_model)
    except BaseException:
        _rebridge(swaps)
        raise
    return swaps


def _rebridge(swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]]) -> None:
    for module, name, child in reversed(swaps):
        module._modules[name] = child


@contextmanager
def unbridged(hf_model: torch.nn.Module) -> Iterator[int]:
    """Swap every TransformerLens bridge component inside `hf_model` back for its original
    Hugging Face module for the duration (restored on exit).

    Args:
        hf_model: A bridge's wrapped Hugging Face model (`bridge.original_model`).

    Yields:
        How many components were swapped.
    """
    swaps = _unbridge(hf_model)
    try:
        yield len(swaps)
    finally:
        _rebridge(swaps)


def unbridged_logits(access: ModelAccess, tokens: Tensor) -> Tensor:
    """The logits of a bridge's Hugging Face model with no TransformerLens code in the pass.

    Args:
        access: The bridge's access layer.
        tokens: Token ids `[batch, pos]`.

    Returns:
        The logits.
    """
    hf_model = access.model.original_model
    with torch.inference_mode(), unbridged(hf_model):
        return hf_model(tokens).logits


class _Aborted(Exception):
    """Ends the lockstep thread's pass after the main pass failed."""


class Lockstep:
    """The unbridged Hugging Face forward of a bridge, in a thread that takes turns with the
    calling thread's pass one decoder layer at a time.

    Each of the two passes runs until it has finished a decoder layer (the bridge's block, or
    the Hugging Face layer inside it), then hands over and waits: the main pass's layer `l`,
    the Hugging Face pass's layer `l`, the main pass's layer `l + 1`, ... When the main pass is
    over, the Hugging Face pass runs to its end. Only one thread runs at any time, and the
    bridge's components are swapped out of the Hugging Face model (`unbridged`) exactly while
    the second one does, so each pass runs its own modules. A layer brought in for one pass
    (de-quantised, copied in) is still in when the other runs it.

    Args:
        access: The model's access layer (a bridge).
        tokens: The probe's token ids.

    Attributes:
        logits: The Hugging Face model's logits once `running` has exited (`None` if it
            failed: `error`).
        error: What the Hugging Face forward raised, if anything.
    """

    def __init__(self, access: ModelAccess, tokens: Tensor) -> None:
        self.hf_model = access.model.original_model
        self.tokens = tokens
        blocks = [access.model.blocks[layer] for layer in range(access.n_layers)]
        self._points = [(block, getattr(block, "original_component", None)) for block in blocks]
        self._cond = threading.Condition()
        self._turn = "main"
        self._main = threading.get_ident()
        self._hf: int | None = None
        self._thread: threading.Thread | None = None
        self._swaps: list[Any] = []
        self._main_done = self._hf_done = self._abort = False
        self.logits: Tensor | None = None
        self.error: BaseException | None = None

    @contextmanager
    def running(self) -> Iterator[None]:
        """Run the calling thread's pass inside: the Hugging Face pass keeps step with it and
        has ended on exit (ended early when the main pass raised).

        Yields:
            Nothing; `logits` and `error` are set on exit.
        """
        handles = []
        if all(isinstance(layer, torch.nn.Module) for _, layer in self._points):
            for block, layer in self._points:
                handles.append(block.register_forward_hook(self._main_point))
                handles.append(layer.register_forward_hook(self._hf_point))
        try:
            yield
        except BaseException:
            self._end(abort=True)
            raise
        else:
            self._end(abort=False)
        finally:
            for handle in handles:
                handle.remove()

    def _start(self) -> None:
        """Give the turn to the Hugging Face pass (the caller holds it and the lock)."""
        self._swaps = _unbridge(self.hf_model)
        self._turn = "hf"
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cw-lens-verify", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _main_point(self, module: Any, args: Any, output: Any) -> None:
        if threading.get_ident() != self._main:
            return
        with self._cond:
            if self._hf_done:
                return
            self._start()
            self._cond.wait_for(lambda: self._turn == "main")

    def _hf_point(self, module: Any, args: Any, output: Any) -> None:
        if threading.get_ident() != self._hf:
            return
        with self._cond:
            if self._abort:
                raise _Aborted
            if self._main_done:  # the main pass is over: run on to the end
                return
            _rebridge(self._swaps)
            self._swaps, self._turn = [], "main"
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == "hf")
            if self._abort:
                raise _Aborted

    def _run(self) -> None:
        self._hf = threading.get_ident()
        try:
            with torch.inference_mode():
                self.logits = self.hf_model(self.tokens).logits
        except _Aborted:
            pass
        except BaseException as exc:  # handed to the caller, which raises it
            self.error = exc
        finally:
            with self._cond:
                _rebridge(self._swaps)
                self._swaps, self._hf_done, self._turn = [], True, "main"
                self._cond.notify_all()

    def _end(self, *, abort: bool) -> None:
        with self._cond:
            self._main_done, self._abort = True, abort
            if self._thread is None and abort:
                return
            if not self._hf_done and self._turn == "main":
                self._start()
            self._cond.wait_for(lambda: self._hf_done)
        if self._thread is not None:
            self._thread.join()


# ------------------------------------------------------------------ the interventions


def probe_edits(access: ModelAccess, layer: int, pattern: Tensor) -> dict[str, Any]:
    """The three interventions checked on `layer`, made from its clean probe pattern.

    Args:
        access: The model's access layer.
        layer: The checked layer.
        pattern: Its clean pattern `[batch, head, query, key]` (the random mask's shape).

    Returns:
        `{name: edit}` for `INTERVENTIONS`.
    """
    gen = torch.Generator().manual_seed(1)
    n = pattern.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device="cpu").tril()
    remove = (torch.rand(pattern.shape, generator=gen, device="cpu") < 0.25) & causal
    all_heads = list(range(access.n_heads))
    return {
        "patch_sink": SinkPatch(layer, all_heads, access.n_heads, 0.0, "scale", [0], None, None),
        "mask_attention": PairMask(layer, remove.to(pattern.device)),
        "remove_heads": HeadRemoval(layer, [0]),
    }


def edit_hooks(access: ModelAccess, name: str, edit: Any, route: str) -> tuple[Any, str]:
    """The hook set that performs `edit`.

    Args:
        access: The model's access layer.
        name: The intervention's name (in the hook set's description).
        edit: The edit (`probe_edits`).
        route: The route pattern-dependent edits act on.

    Returns:
        The hook set, and the route it acts on (`"hook_z"` for a head removal).
    """
    if isinstance(edit, HeadRemoval):
        return head_removal_hooks(access.model, [edit], "probe"), "hook_z"
    return realise(access.model, [edit], f"probe {name}", route=route), route


def _route(order: dict[int, list[str]]) -> str:
    """`ModelAccess.route` of the layers in `order` (the rule of `cw_lens.models.access`)."""
    for fired in order.values():
        kinds = list(dict.fromkeys(fired))
        if kinds.index("z") < max(kinds.index("pattern"), kinds.index("values")):
            return "attention output"
    return "hook_z"


def _fresh(value: Any) -> Any:
    """A copy of a module input that a run cannot change for the next one: tensors cloned,
    key/value caches (which an attention module extends) deep-copied."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # a transformers without cache objects
        Cache = ()

    if isinstance(value, Tensor):
        return value.detach().clone()
    if type(value) is tuple or type(value) is list:
        return type(value)(_fresh(v) for v in value)
    if type(value) is dict:
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, Cache):
        return copy.deepcopy(value)
    return value


def _hooks_of(module: torch.nn.Module) -> list[tuple[dict, set]]:
    """The forward (pre-)hook dicts of `module` and its submodules, each with its keys now."""
    return [
        (hooks, set(hooks))
        for m in module.modules()
        for hooks in (m._forward_hooks, m._forward_pre_hooks)
    ]


@contextmanager
def _held_back(kept: list[tuple[dict, set]]) -> Iterator[None]:
    """Run only the hooks that were there before the pass (and those added inside): the dicts
    are edited in place, so the pass's handles still remove their hooks afterwards."""
    saved = []
    for hooks, keys in kept:
        items = list(hooks.items())
        saved.append((hooks, items))
        for key, _ in items:
            if key not in keys:
                del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


# ------------------------------------------------------------------ the probe pass


class Probe:
    """The hooks of the probe pass and what they read (a context manager, entered as an
    intervention is). Made before any hook of the pass is added: the hooks on the checked
    layer's attention module then are the model's own, the only ones its re-runs keep.

    Args:
        access: The model's access layer.

    Attributes:
        clean: Per layer `pattern`, `values`, `z`, `out`, `attention`, `weights`, `facts`.
        order: Per layer, the hook kinds in the order they fired.
        weights: Per layer the output weights a flow pass read already (shared with it).
        layer: The layer the interventions are checked on.
        edits, routes, intervened: Per intervention the edit, the route it acted on and the
            attention module's output under it.
        route: The route the interventions were realised on (the hook order of the layers
            up to `layer`, or the model's known route).
        error: What the re-runs raised (the interventions are then checked in passes of
            their own).
    """

    def __init__(self, access: ModelAccess) -> None:
        n = access.n_layers
        self.access = access
        self.layer = n // 2
        self.clean: dict[int, dict[str, Any]] = {layer: {} for layer in range(n)}
        self.order: dict[int, list[str]] = {layer: [] for layer in range(n)}
        self.weights: dict[int, Any] = {}
        self.edits: dict[str, Any] = {}
        self.routes: dict[str, str] = {}
        self.intervened: dict[str, Tensor] = {}
        self.route: str | None = None
        self.error: BaseException | None = None
        self._model_hooks = _hooks_of(access.attention_module(self.layer))
        self._inputs: tuple[Any, Any] | None = None
        self._stack = ExitStack()

    def __enter__(self) -> Probe:
        access = self.access
        tl_hooks, module_hooks = [], []
        for layer in range(access.n_layers):
            for kind in ATTENTION_HOOKS:
                tl_hooks.append((access.hook_name(kind, layer), self._keeper(layer, kind)))
            module_hooks.append((access.output_projection(layer), self._out_keeper(layer)))
            module_hooks.append((access.attention_module(layer), self._attention_keeper(layer)))
        try:
            self._stack.enter_context(access.hooks(tl_hooks))
            self._stack.enter_context(access.module_hooks(module_hooks))
            attn = access.attention_module(self.layer)
            handle = attn.register_forward_pre_hook(self._keep_inputs, with_kwargs=True)
            self._stack.callback(handle.remove)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _keeper(self, layer: int, kind: str) -> Any:
        def keep(t: Tensor, hook: Any) -> None:
            self.clean[layer][kind] = t.detach().clone()
            self.order[layer].append(kind)

        return keep

    def _out_keeper(self, layer: int) -> Any:
        def keep_out(module: Any, args: Any, output: Any) -> None:
            from cw_lens.models.weight_processing import layer_facts

            got = self.clean[layer]
            got["out"] = first(output).detach().clone()
            # read while the layer runs: a streamed layer is de-quantised once for all of them
            kept = self.weights.get(layer)
            got["weights"] = kept if kept is not None else self.access.output_weights(layer)
            got["facts"] = layer_facts(self.access, layer)

        return keep_out

    def _attention_keeper(self, layer: int) -> Any:
        def keep_attention(module: Any, args: Any, output: Any) -> None:
            self.clean[layer]["attention"] = first(output).detach().clone()
            if layer == self.layer:
                self._rerun(module)

        return keep_attention

    def _keep_inputs(self, module: Any, args: Any, kwargs: Any) -> None:
        self._inputs = (_fresh(args), _fresh(kwargs))

    def _rerun(self, module: Any) -> None:
        """The checked layer's attention module again, under each intervention."""
        access = self.access
        try:
            known = "hook_order" in vars(access)  # measured before: no probe pass to read it
            run = {layer: self.order[layer] for layer in range(self.layer + 1)}
            self.route = access.route if known else _route(run)
            pattern = self.clean[self.layer]["pattern"].float()
            self.edits = probe_edits(access, self.layer, pattern)
            args, kwargs = self._inputs  # type: ignore[misc]
            for name, edit in self.edits.items():
                hook_set, self.routes[name] = edit_hooks(access, name, edit, self.route)
                with _held_back(self._model_hooks), hook_set:
                    output = module(*_fresh(args), **_fresh(kwargs))
                self.intervened[name] = first(output).detach().clone()
        except Exception as exc:  # checked again in passes of their own, which raise it
            self.error = exc

    def finish(self) -> None:
        """Refuse a model whose attention module did not run; note the hook order.

        Raises:
            UnsupportedModelError: An attention module did not run in the pass.
        """
        missing = [
            (layer, kind)
            for layer, got in self.clean.items()
            for kind in ("out", "attention")
            if kind not in got
        ]
        if missing:
            raise UnsupportedModelError(
                f"{self.access.architecture}: the attention module of layer {missing[0][0]} did "
                "not run in a forward pass; cw_lens cannot read this model's attention output."
            )
        self.access.note_hook_order(self.order)

    @property
    def interventions_read(self) -> bool:
        """Whether the re-runs read every intervention on the model's route.

        Returns:
            True when `intervened` holds every intervention, realised on `access.route`.
        """
        return (
            self.error is None
            and self.route == self.access.route
            and set(self.intervened) == set(INTERVENTIONS)
        )


@dataclass
class ProbePass:
    """What one probe pass read: the `Probe`, the logits, the unbridged Hugging Face logits
    (when they ran in lockstep, or their `hf_error`) and the kinds of the blocks the flow
    checks passed (`None` when they did not run)."""

    probe: Probe
    logits: Tensor | None
    hf_logits: Tensor | None = None
    hf_error: BaseException | None = None
    flow_kinds: set[str] | None = None


def probe_pass(access: ModelAccess, tokens: Tensor, *, flow: bool) -> ProbePass:
    """The probe pass (see the module docstring).

    Args:
        access: The model's access layer.
        tokens: The probe's token ids `[batch, pos]`.
        flow: Run the flow analyses' block checks in the pass (`run_blocks` drives it).

    Returns:
        What the pass read.

    Raises:
        UnsupportedModelError: A check refused the model inside the pass (a flow check, or
            an attention module that did not run).
    """
    probe = Probe(access)  # before any hook of the pass
    lockstep = None
    if access.api == "bridge" and is_offloaded(access.model):
        lockstep = Lockstep(access, tokens)
    kinds: set[str] = set()

    def note(block: Any) -> None:
        kinds.add("sequential" if block.resid_mid is not None else "parallel")
        if block.attn_map.gain is not None:
            kinds.add("post-norm linearised")

    with lockstep.running() if lockstep is not None else nullcontext():
        if flow:
            n_batch, n_pos = tokens.shape
            mask = torch.ones(n_batch, n_pos, dtype=torch.bool, device=tokens.device)
            batch = TokenBatch(tokens, mask, False, None, list(range(n_batch)))
            logits = run_blocks(
                access.model,
                batch,
                note,
                layers=list(range(access.n_layers)),
                fwd_hooks=[probe],
                need_logits=True,
                weights=probe.weights,
            )
        else:
            with torch.inference_mode(), probe:
                logits = access.probe_forward(tokens)
    probe.finish()
    return ProbePass(
        probe,
        logits,
        hf_logits=None if lockstep is None else lockstep.logits,
        hf_error=None if lockstep is None else lockstep.error,
        flow_kinds=kinds if flow else None,
    )
