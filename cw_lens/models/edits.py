r"""The machinery of interventions: exact attention edits and the hook sets that realise them.

Every function returns a [`HookSet`][cw_lens.HookSet], which is at once

- a context manager — `with cw_lens.patch_sink(model, layers=[3]): model(tokens)`;
- a list of `(hook_name, fn)` pairs — `model.run_with_hooks(x, fwd_hooks=list(patch))` or
  `with model.hooks(fwd_hooks=[*patch, *my_hooks]): ...` (on models of the attention-output
  route, below, pattern-dependent sets work only as context managers and say so).

Hooks only act inside the context (or the `hooks(...)` call) and are removed on exit, so the
model is restored exactly. Sets compose: `a + b` or nested `with`.

Every intervention is an exact edit of `z_i^h = sum_j alpha[i,j]^h v_j^{g(h)}` (linear in
`alpha` and in the values):

- **Sink-norm ablation** (P1, methods § Attention sinks (docs/methods.md#sinks)): `pv_0^h -> lambda
  pv_0^h` for every query `i` that is
  not itself a sink, attention untouched:

      z_i^h  <-  z_i^h - (1 - lambda) * alpha[i,0]^h * v_0^{g(h)}

  which changes only query head `h` — not the other heads sharing `v_0^{g(h)}` under GQA.
  `mode="norm_matched"` picks `lambda` per (sequence, head) so that `||lambda pv_0^h||` is
  the mean norm of the head's non-sink projected values.
- **Pair masking** (P1 faithfulness): `alpha[i,j]^h -> 0` without renormalising, i.e.
  `z_i^h <- z_i^h - alpha[i,j]^h v_j`.
- **Head removal** (P2 pruning): `z^h <- 0`.

Where it is realised depends on how the model wires its hooks
(`cw_lens.models.access.ModelAccess.route`, measured, then verified by
[`cw_lens.verify_model`][cw_lens.verify_model]): on the **hook_z route** (`hook_pattern` and
`hook_v` fire before `hook_z`: Llama, GPT-2, Gemma, every HookedTransformer, ...) pair masks edit
`hook_pattern` and sink patches edit `hook_z`; on the **attention-output route** (the pattern
fires after `z`: GPT-J, GPT-Neo, OPT, XGLM bridges) both subtract `delta W_O` from the
attention module's output through a PyTorch forward hook. Head removal edits `hook_z` on every
model. Activations that cw_lens captures inside an entered intervention describe the edited
layer exactly: the edit is accounted for as an effective attention pattern (a sink patch scales
`alpha[i,0]` by `lambda` — the same weights as scaling `pv_0`).
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from cw_lens.core.errors import InputError
from cw_lens.core.geometry import grouped_scores_values, projected_value_norms, sink_term
from cw_lens.models.access import Model, model_access

Hook = tuple[str, Callable]
ModuleHook = tuple[torch.nn.Module, Callable]
MAX_SINK_SCALE = 2.0


class HookSet:
    """Hooks that act together: a context manager and an iterable of `(hook_name, fn)` pairs.

    A hook set pickles (and `copy.deepcopy`s) as its spec — the edits and the description,
    never the model or the hook closures. Unpickled in the process that holds its model (that
    model still alive), it is bound to that model again and acts exactly as the original;
    elsewhere it is unbound until `bind(model)` (the same model, loaded again) gives the
    working set. Hook pairs added by hand (`hook_set + [(name, fn)]`) travel as pickle
    carries their functions (module-level functions do; closures and lambdas do not).

    Attributes:
        hooks: TransformerLens hook pairs.
        module_hooks: PyTorch forward hooks on attention modules (attention-output route).
        edits: The exact attention edits these hooks perform (what captured activations account
            for while the set is entered).

    Examples:
        >>> import copy
        >>> import cw_lens
        >>> model = cw_lens.load_model("testing:tiny-llama")
        >>> patch = cw_lens.patch_sink(model, layers=[1], heads=[0])
        >>> again = copy.deepcopy(patch)  # as a pickle moves it to a worker process
        >>> again.model is model, len(again) == len(patch)
        (True, True)
    """

    def __init__(
        self,
        model: Model,
        hooks: Iterable[Hook] = (),
        description: str = "",
        *,
        module_hooks: Iterable[ModuleHook] = (),
        edits: Iterable[Any] = (),
        recipe: list[tuple[str, list[Any]]] | None = None,
    ) -> None:
        """A hook set; interventions build them ([`patch_sink`][cw_lens.patch_sink], ...).

        Args:
            model: The model the hooks are for.
            hooks: TransformerLens `(hook_name, fn)` pairs.
            description: What the hooks do, for the repr.
            module_hooks: PyTorch forward hooks `(module, fn)` on attention modules.
            edits: The exact attention edits the hooks perform.
            recipe: How the set was built (`(intervention, arguments)` pairs), what it pickles as.
        """
        self.model = model
        self.hooks: list[Hook] = list(hooks)
        self.module_hooks: list[ModuleHook] = list(module_hooks)
        self.edits: list[Any] = list(edits)
        self.description = description
        self._contexts: list[Any] = []
        # how to build these hooks again (what a pickle holds): ("realise", edits),
        # ("remove", edits) or ("hooks", hook pairs given by hand)
        if recipe is None:
            recipe = [("hooks", list(self.hooks))] if self.hooks or self.module_hooks else []
            if self.module_hooks:
                recipe.append(("module hooks", list(self.module_hooks)))
        self._recipe = recipe

    def __iter__(self) -> Iterator[Hook]:
        self._check_bound()
        if self.module_hooks:
            raise InputError(
                f"{self.description or 'This intervention'} acts on the attention modules' output "
                "on this model (its attention fires hook_pattern after hook_z, so the edit cannot "
                "be a TransformerLens hook). Use it as a context manager: `with hook_set: ...`."
            )
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks) + len(self.module_hooks)

    def __add__(self, other: HookSet | Sequence[Hook]) -> HookSet:
        """Combine with another hook set (of the same model) or a list of hook pairs."""
        self._check_bound()
        if not isinstance(other, HookSet):
            other = HookSet(self.model, list(other))
        other._check_bound()
        if other.model is not self.model:
            raise InputError("Cannot combine hook sets of two different models.")
        desc = " + ".join(d for d in (self.description, other.description) if d)
        return HookSet(
            self.model,
            [*self.hooks, *other.hooks],
            desc,
            module_hooks=[*self.module_hooks, *other.module_hooks],
            edits=[*self.edits, *other.edits],
            recipe=[*self._recipe, *other._recipe],
        )

    def __enter__(self) -> HookSet:
        self._check_bound()
        access = model_access(self.model)
        contexts = [access.hooks(self.hooks), access.module_hooks(self.module_hooks)]
        for ctx in contexts:
            ctx.__enter__()
        access.active_edits.extend(self.edits)
        self._contexts.append(contexts)
        return self

    def __exit__(self, *exc: Any) -> None:
        access = model_access(self.model)
        for edit in self.edits:
            access.active_edits.remove(edit)
        for ctx in reversed(self._contexts.pop()):
            ctx.__exit__(*exc)

    def __repr__(self) -> str:
        if self.model is None:
            return f"HookSet({self.description or 'hooks'}, unbound: call .bind(model))"
        return f"HookSet({self.description or 'hooks'}, {len(self)} hooks)"

    # ----------------------------------------------------------------- pickling
    def bind(self, model: Model) -> HookSet:
        """The same hooks, built for `model`.

        For a hook set unpickled in another process (or after its model was deleted): pass
        the model it was made for, loaded again. Edits keep what they read from the original
        model's weights (the Gram matrices of `mode="norm_matched"`), so bind a model with
        the same weights.

        Args:
            model: The model (same architecture and weights as the original one).

        Returns:
            A new, bound `HookSet`.

        Raises:
            InputError: when the set holds PyTorch module hooks given by hand (they name
                modules of the original model).

        Examples:
            >>> import cw_lens
            >>> model = cw_lens.load_model("testing:tiny-llama")
            >>> patch = cw_lens.patch_sink(model, layers=[0])
            >>> len(patch.bind(model)) == len(patch)
            True
        """
        bound = HookSet(model, description=self.description)
        for kind, items in self._recipe:
            if kind == "realise":
                part = realise(model, items, self.description)
            elif kind == "remove":
                part = head_removal_hooks(model, items, self.description)
            elif kind == "hooks":
                part = HookSet(model, items)
            else:
                raise InputError(
                    "This hook set holds PyTorch module hooks given by hand; they belong to the "
                    "modules of its original model and cannot be bound to another."
                )
            bound = bound + part
        bound.description = self.description
        return bound

    def _check_bound(self) -> None:
        if self.model is None:
            raise InputError(
                f"This HookSet ({self.description or 'hooks'}) was unpickled away from its "
                "model; bind it first: `hook_set = hook_set.bind(model)`."
            )

    def __getstate__(self) -> dict[str, Any]:
        if any(kind == "module hooks" for kind, _ in self._recipe):
            raise TypeError(
                "A HookSet with PyTorch module hooks given by hand cannot be pickled: they "
                "belong to the modules of its model. Pickle the intervention that made it."
            )
        key = None if self.model is None else _model_key(self.model)
        return {"description": self.description, "recipe": self._recipe, "model_key": key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        model = _MODELS.get(state["model_key"]) if state.get("model_key") else None
        if model is not None:
            self.__dict__.update(vars(HookSet.bind(_unbound(state), model)))
        else:
            self.__dict__.update(vars(_unbound(state)))


def _unbound(state: dict[str, Any]) -> HookSet:
    """A hook set of no model holding `state`'s spec (what `bind` builds from)."""
    hook_set = HookSet(None, description=state["description"], recipe=list(state["recipe"]))
    return hook_set


# the models hook sets were made for, by a key a pickle keeps: an unpickled set finds its model
# again while that model lives in this process
_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MODELS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _model_key(model: Any) -> str:
    key = _KEYS.get(model)
    if key is None:
        key = uuid.uuid4().hex
        _KEYS[model] = key
        _MODELS[key] = model
    return key


# --------------------------------------------------------------------------- the edits


def _compute_dtype(t: Tensor) -> torch.dtype:
    """float32 for half- and single-precision tensors, float64 for float64 ones."""
    return torch.promote_types(t.dtype, torch.float32)


class _PatternEdit:
    """Base of the pattern-dependent edits; subclasses define `keep` (the effective
    attention as a multiple of `alpha`, or a mask) and `delta`."""

    layer: int
    on_output: bool = False

    def effective_pattern(self, pattern: Tensor, values: Tensor) -> Tensor:
        raise NotImplementedError

    def delta(self, pattern: Tensor, values: Tensor) -> Tensor:
        """`z - z'` `[batch, query, head, d_head]` (float32, or float64 for such models)."""
        dtype = _compute_dtype(pattern)
        removed = pattern.to(dtype) - self.effective_pattern(pattern, values).to(dtype)
        return grouped_scores_values(removed, values.to(dtype))


class SinkPatch(_PatternEdit):
    """`pv_s^h -> lambda pv_s^h` at the sinks `s` of the chosen heads (non-sink queries)."""

    def __init__(
        self,
        layer: int,
        heads: list[int],
        n_heads: int,
        scale: float,
        mode: str,
        sinks: list[int],
        real_mask: Tensor | None,
        gram: Tensor | None,
    ) -> None:
        self.layer, self.heads, self.n_heads = layer, heads, n_heads
        self.scale, self.mode, self.sinks = scale, mode, sinks
        self.real_mask, self.gram = real_mask, gram

    def _sink_mask(self, n_batch: int, n_pos: int, device: torch.device) -> Tensor:
        mask = torch.zeros(n_batch, n_pos, dtype=torch.bool, device=device)
        mask[:, [s for s in self.sinks if s < n_pos]] = True
        return mask

    def removed_share(self, values: Tensor, sink_mask: Tensor) -> Tensor:
        """`1 - lambda` per (batch, query head); 0 for heads not patched."""
        n_batch, n_pos = sink_mask.shape
        device = values.device
        if self.mode == "norm_matched":
            norms = projected_value_norms(values.float(), self.gram.to(device))
        else:
            norms = torch.zeros(n_batch, self.n_heads, 1, device=device)
        real = None if self.real_mask is None else self.real_mask[:, :n_pos].to(device)
        factor = sink_scale(self.mode, self.scale, norms, sink_mask, real)
        chosen = torch.zeros(self.n_heads, dtype=torch.bool, device=device)
        chosen[self.heads] = True
        return torch.where(chosen[None], factor, torch.zeros_like(factor))

    def effective_pattern(self, pattern: Tensor, values: Tensor) -> Tensor:
        n_batch, _, n_query, n_key = pattern.shape
        sink_mask = self._sink_mask(n_batch, n_key, pattern.device)
        factor = self.removed_share(values, sink_mask)  # [batch, head]
        # alpha[i, s] -> (1 - factor) alpha[i, s] at sink keys s of queries i that are no sink
        rows = ~sink_mask[:, None, :n_query, None]
        cols = sink_mask[:, None, None, :]
        scale = 1.0 - factor[:, :, None, None] * (rows & cols).to(factor.dtype)
        return pattern.to(_compute_dtype(pattern)) * scale.to(_compute_dtype(pattern))

    def delta(self, pattern: Tensor, values: Tensor) -> Tensor:
        n_batch, _, n_query, n_key = pattern.shape
        sink_mask = self._sink_mask(n_batch, n_key, pattern.device)
        factor = self.removed_share(values, sink_mask)
        dtype = _compute_dtype(pattern)
        term = sink_term(pattern.to(dtype), values.to(dtype), sink_mask)  # [batch, query, head, d]
        term = term.masked_fill(sink_mask[:, :n_query, None, None], 0.0)  # sinks keep theirs
        return factor[:, None, :, None] * term


class PairMask(_PatternEdit):
    """`alpha[i,j]^h -> 0` where `mask` is True (no renormalisation)."""

    def __init__(self, layer: int, mask: Tensor | Callable[[Tensor], Tensor]) -> None:
        self.layer, self.mask = layer, mask

    def removed(self, pattern: Tensor) -> Tensor:
        mask = self.mask(pattern) if callable(self.mask) else self.mask
        mask = torch.as_tensor(mask, device=pattern.device).to(pattern.device)
        if mask.dtype != torch.bool:
            raise InputError(
                f"Attention masks must be bool tensors (True = remove), got {mask.dtype}."
            )
        return mask

    def masked(self, pattern: Tensor) -> Tensor:
        """`pattern` with the removed pairs set to 0: one pass writing a new tensor (an
        out-of-place `masked_fill` copies, then fills)."""
        return torch.where(self.removed(pattern), 0.0, pattern)

    def effective_pattern(self, pattern: Tensor, values: Tensor) -> Tensor:
        return self.masked(pattern)

    def delta(self, pattern: Tensor, values: Tensor) -> Tensor:
        dtype = _compute_dtype(pattern)
        kept = pattern.to(dtype) * self.removed(pattern).to(dtype)
        return grouped_scores_values(kept, values.to(dtype))


class HeadRemoval:
    """`z^h <- 0` for the given heads (realised on `hook_z` on every model)."""

    on_output = False

    def __init__(self, layer: int, heads: list[int]) -> None:
        self.layer, self.heads = layer, heads

    def effective_pattern(self, pattern: Tensor, values: Tensor) -> Tensor:
        out = pattern.clone()
        out[:, self.heads] = 0.0
        return out

    def delta(self, pattern: Tensor, values: Tensor) -> Tensor:
        dtype = _compute_dtype(pattern)
        full = grouped_scores_values(pattern.to(dtype), values.to(dtype))
        keep = torch.zeros(full.shape[2], dtype=torch.bool, device=full.device)
        keep[self.heads] = True
        return full * keep[None, None, :, None]

    def zero_heads(self, z: Tensor, hook: Any) -> Tensor:
        z = z.clone()
        z[:, :, self.heads, :] = 0.0
        return z


# --------------------------------------------------------------------------- realisation


def realise(
    model: Any, edits: Sequence[_PatternEdit], description: str, *, route: str | None = None
) -> HookSet:
    """Turn pattern-dependent edits into the hooks that perform them on this model's route.

    Args:
        model: The model.
        edits: The pattern-dependent edits.
        description: The hook set's description.
        route: The route to realise them on, where it is known without
            `ModelAccess.route`'s probe pass (verification's own pass, which measures it);
            `None`: the model's route.

    Returns:
        The hook set.
    """
    access = model_access(model)
    route = access.route if route is None else route
    hooks: list[Hook] = []
    module_hooks: list[ModuleHook] = []
    for edit in edits:
        if isinstance(edit, PairMask) and route == "hook_z":
            hooks.append((access.hook_name("pattern", edit.layer), _mask_pattern(edit)))
            continue
        store: dict[str, Tensor] = {}
        hooks += [
            (access.hook_name("pattern", edit.layer), _keep(store, "pattern")),
            (access.hook_name("values", edit.layer), _keep(store, "values")),
        ]
        if route == "hook_z":
            hooks.append((access.hook_name("z", edit.layer), _edit_z(edit, store)))
        else:
            edit.on_output = True
            W_O = access.output_weights(edit.layer).W_O
            module_hooks.append(
                (access.attention_module(edit.layer), _edit_output(edit, store, W_O))
            )
    return HookSet(
        model,
        hooks,
        description,
        module_hooks=module_hooks,
        edits=edits,
        recipe=[("realise", list(edits))],
    )


def _keep(store: dict[str, Tensor], name: str) -> Callable:
    def fn(t: Tensor, hook: Any) -> None:
        store[name] = t

    return fn


def _mask_pattern(edit: PairMask) -> Callable:
    def fn(pattern: Tensor, hook: Any) -> Tensor:
        return edit.masked(pattern)

    return fn


def _edit_z(edit: _PatternEdit, store: dict[str, Tensor]) -> Callable:
    def fn(z: Tensor, hook: Any) -> Tensor:
        pattern, values = store.pop("pattern"), store.pop("values")
        return z - edit.delta(pattern, values).to(z.dtype)

    return fn


def _edit_output(edit: _PatternEdit, store: dict[str, Tensor], W_O: Tensor) -> Callable:
    def fn(module: Any, args: Any, output: Any) -> Any:
        pattern, values = store.pop("pattern"), store.pop("values")
        delta = edit.delta(pattern, values)
        delta = torch.einsum("bqhd,hdm->bqm", delta, W_O.to(delta.device, delta.dtype))
        if isinstance(output, (tuple, list)):
            return type(output)([output[0] - delta.to(output[0].dtype), *output[1:]])
        return output - delta.to(output.dtype)

    return fn


def sink_scale(
    mode: str,
    scale: float,
    norms: Tensor,
    sink_mask: Tensor,
    real_mask: Tensor | None = None,
) -> Tensor:
    """`1 - lambda` per (batch, head): the share of the sink term that the patch removes.

    Args:
        mode: `"scale"` (`lambda = scale`) or `"norm_matched"` (`lambda` = mean norm of
            the head's non-sink projected values / mean norm of its sink projected values).
        norms: `||pv_j^h||` `[batch, head, pos]`.
        sink_mask: `[batch, pos]` True at sinks; `real_mask`: True at real tokens.
    """
    n_batch, n_heads, _ = norms.shape
    if mode == "scale":
        return torch.full((n_batch, n_heads), 1.0 - scale, device=norms.device)
    real = torch.ones_like(sink_mask) if real_mask is None else real_mask
    tail = (real & ~sink_mask).to(norms.dtype)[:, None, :]
    sinks = sink_mask.to(norms.dtype)[:, None, :]
    tail_mean = (norms * tail).sum(-1) / tail.sum(-1).clamp_min(1)
    sink_mean = (norms * sinks).sum(-1) / sinks.sum(-1).clamp_min(1)
    return 1.0 - tail_mean / sink_mean.clamp_min(1e-30)


def head_removal_hooks(model: Any, edits: Sequence[HeadRemoval], description: str) -> HookSet:
    access = model_access(model)
    hooks = [(access.hook_name("z", edit.layer), edit.zero_heads) for edit in edits]
    return HookSet(model, hooks, description, edits=edits, recipe=[("remove", list(edits))])
