"""Model access: one interface over a `TransformerBridge` and a `HookedTransformer`.

Everything cw_lens needs from a TransformerLens model — hook names, the output projection, the
attention module whose output is `sum_h z^h W_O^h + b_O`, the forward pass, hook contexts — is
read here, so no analysis asks what kind of model it holds:

- `TransformerBridge` (TransformerLens 3.x and 4.x): classic hook names are aliases of the
  bridge's own (`blocks.{l}.attn.hook_z` is the input of the output projection);
- `HookedTransformer` (TransformerLens 2.x and 3.x): the classic hooks themselves.

The layer output `o_i = sum_h z_i^h W_O^h` is always computed from `hook_z` and `W_O`
(docs/methods.md#notation), never read from `hook_attn_out`: on post-norm blocks (Gemma 2/3, OLMo
2/3, GLM-4, EXAONE 4) that hook is the output of the post-attention norm, and on Granite it carries
the residual multiplier. Whether a model's hooks really satisfy `pattern @ v == z` and `sum_h z
W_O + b_O ==` the attention module's output is checked by
[`cw_lens.verify_model`][cw_lens.verify_model] before any number is returned.

Two wirings of the attention hooks exist: on most architectures `hook_pattern` and `hook_v`
fire before `hook_z` (an edit of `z` computed from the pattern is possible in the `hook_z`
hook — the **hook_z route**); on bridges that delegate attention to the Hugging Face module and
fire `hook_pattern` afterwards (GPT-J, GPT-Neo, OPT, XGLM) the pattern is only known once the
attention module has run, so pattern-dependent interventions edit the module's output through a
PyTorch forward hook — the **attention-output route**. `ModelAccess.route` is measured by
a probe pass, not assumed from the architecture's name.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer
    from transformer_lens.model_bridge import TransformerBridge

import torch
from jaxtyping import Float, Float32
from torch import Tensor

from cw_lens.core.errors import CwLensError, InputError, UnsupportedModelError
from cw_lens.core.geometry import head_gram
from cw_lens.models.arguments import Api, api_of, check_model
from cw_lens.models.arguments import resolve_heads as resolve_heads
from cw_lens.models.arguments import resolve_layers as resolve_layers
from cw_lens.models.offload import (
    execution_device,
    read_weights,
    read_weights_and_placement,
)

HOOK_TEMPLATES = {
    "pattern": "blocks.{layer}.attn.hook_pattern",
    "values": "blocks.{layer}.attn.hook_v",
    "z": "blocks.{layer}.attn.hook_z",
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "resid_mid": "blocks.{layer}.hook_resid_mid",
    "resid_post": "blocks.{layer}.hook_resid_post",
    "attn_out": "blocks.{layer}.hook_attn_out",
    "mlp_out": "blocks.{layer}.hook_mlp_out",
}
# the hooks contribution weights read
ATTENTION_HOOKS = ("pattern", "values", "z")

Model: TypeAlias = "TransformerBridge | HookedTransformer"
"""A TransformerLens model: a `TransformerBridge` (TransformerLens 3.x, 4.x) or a
`HookedTransformer` (2.x, 3.x), the type of every `model` argument of cw_lens.

A forward reference, so that naming it imports no TransformerLens: annotate your own code with
`model: cw_lens.Model`. At run time it is the string `"TransformerBridge | HookedTransformer"`;
which of the two a model is, and whether cw_lens can analyse it, is checked when an analysis
first sees it ([`verify_model`][cw_lens.verify_model]).
"""
Route = Literal["hook_z", "attention output"]


class StreamDone(Exception):
    """Raised from a hook to end a pass whose remaining layers are not needed."""


class AttentionEdit(Protocol):
    """An exact edit of one layer's attention (an intervention of
    `cw_lens.models.interventions`).

    The model computes `z' = z - delta(pattern, values)`; cw_lens accounts for it as an edit of
    the attention pattern, `effective_pattern(pattern, values) @ values == z'`, so activations
    captured under the edit stay consistent. `on_output` is True when the edit is realised on
    the attention module's output (the attention-output route): the model's `hook_z` then
    still shows the unedited `z`.
    """

    layer: int
    on_output: bool

    def effective_pattern(self, pattern: Tensor, values: Tensor) -> Tensor: ...

    def delta(self, pattern: Tensor, values: Tensor) -> Tensor: ...


def hook_name(kind: str, layer: int) -> str:
    """The classic TransformerLens hook name of `kind` at `layer`."""
    try:
        return HOOK_TEMPLATES[kind].format(layer=layer)
    except KeyError:
        raise InputError(
            f"Unknown hook kind {kind!r}; one of {', '.join(HOOK_TEMPLATES)}."
        ) from None


@check_keywords
def cache_names(layers: int | Sequence[int]) -> list[str]:
    """The hook names contribution weights read, for `run_with_cache(names_filter=...)`.

    Args:
        layers: A layer or several.

    Returns:
        The hook names, three per layer (`hook_pattern`, `hook_v`, `hook_z`).

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        tokens = model.to_tokens("The cat sat on the mat.")
        _, cache = model.run_with_cache(tokens, names_filter=cw_lens.cache_names([0, 1]))
        cw = cw_lens.contribution_weights_from_cache(cache, model, layer=1)
        ```
    """
    layers = [layers] if isinstance(layers, int) else list(layers)
    return [hook_name(kind, layer) for layer in layers for kind in ATTENTION_HOOKS]


@saveable
@dataclass
class LayerWeights:
    """The output projection of one layer, float32: `W_O` [head, d_head, d_model], `b_O`."""

    W_O: Float32[Tensor, "head d_head d_model"]
    b_O: Float32[Tensor, " d_model"] | None
    gram: Float32[Tensor, "head d_head d_head"]
    # read from an offloaded layer (`cw_lens.models.offload`): a copy, not kept across passes
    offloaded: bool = False

    @classmethod
    def from_weights(
        cls, W_O: Tensor, b_O: Tensor | None, *, offloaded: bool = False
    ) -> LayerWeights:
        W_O = W_O.detach().float()
        b_O = None if b_O is None else b_O.detach().float()
        return cls(W_O, b_O, head_gram(W_O), offloaded)

    def to(self, device: torch.device) -> LayerWeights:
        if self.W_O.device == torch.device(device):
            return self
        b_O = None if self.b_O is None else self.b_O.to(device)
        return LayerWeights(self.W_O.to(device), b_O, self.gram.to(device), self.offloaded)

    @cached_property
    def _W_O_by_dim(self) -> Float[Tensor, "d_head_head d_model"]:
        """`W_O` as one matrix with the rows in `(d_head, head)` order (made once)."""
        return self.W_O.transpose(0, 1).reshape(-1, self.W_O.shape[-1]).contiguous()

    def layer_output(self, z: Float[Tensor, "batch pos head d_head"]) -> Tensor:
        """`o_i = sum_h z_i^h W_O^h` (`b_O` excluded), float32 `[batch, pos, d_model]`.

        One matrix product over `(d_head, head)` (the order in which `einsum` sums them),
        with `W_O` rearranged once per layer rather than on every call."""
        flat = z.float().transpose(-1, -2).reshape(*z.shape[:-2], -1)
        return torch.matmul(flat, self._W_O_by_dim.to(z.device))


class ModelAccess:
    """Read access to one TransformerLens model (bridge or HookedTransformer); see the module doc.

    Attributes:
        model: The model.
        api: `"bridge"` or `"hooked"`.
        architecture: The Hugging Face architecture (bridge) or `HookedTransformer(<original
            architecture>)`.
        n_layers, n_heads, n_kv_heads, d_head, d_model, n_ctx, d_vocab: Dimensions.
    """

    def __init__(self, model: Any) -> None:
        api = api_of(model)
        if api is None:
            raise UnsupportedModelError(
                f"cw_lens analyses TransformerLens models; got {type(model).__name__}. Load a "
                "TransformerBridge with cw_lens.load_model(...) (or "
                "TransformerBridge.boot_transformers(...)), or pass a HookedTransformer."
            )
        self._model = weakref.ref(model)
        self.api: Api = api
        cfg = model.cfg
        self.n_layers = int(cfg.n_layers)
        self.n_heads = int(cfg.n_heads)
        self.n_kv_heads = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
        self.d_head = int(cfg.d_head)
        self.d_model = int(cfg.d_model)
        self.n_ctx = int(getattr(cfg, "n_ctx", 0) or 0)
        self.d_vocab = int(getattr(cfg, "d_vocab", 0) or 0)
        # hook names found on the model (a model's hook points do not go away)
        self._known_hooks: set[str] = set()
        self._check_structure()
        # edits of the interventions currently entered (`with`) on this model, in order
        self.active_edits: list[AttentionEdit] = []
        # layer weights kept across passes inside `weights_kept` (None: read in each pass)
        self._kept_weights: dict[int, LayerWeights] | None = None

    # ----------------------------------------------------------------- identity
    @property
    def model(self) -> Any:
        model = self._model()
        if model is None:
            raise InputError("The model of this ModelAccess no longer exists.")
        return model

    @property
    def name(self) -> str:
        return str(getattr(self.model.cfg, "model_name", "") or type(self.model).__name__)

    @cached_property
    def architecture(self) -> str:
        cfg = self.model.cfg
        if self.api == "bridge":
            hf_config = getattr(self.model.original_model, "config", None)
            names = getattr(hf_config, "architectures", None) or []
            return str(names[0] if names else getattr(cfg, "architecture", None) or self.name)
        original = getattr(cfg, "original_architecture", None)
        return f"HookedTransformer({original or self.name})"

    @property
    def tokenizer(self) -> Any:
        return getattr(self.model, "tokenizer", None)

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @cached_property
    def hf_config(self) -> Any:
        """The Hugging Face config of a bridge's wrapped model (`None` for HookedTransformer)."""
        if self.api != "bridge":
            return None
        return getattr(getattr(self.model, "original_model", None), "config", None)

    def _check_structure(self) -> None:
        direction = getattr(self.model.cfg, "attention_dir", "causal")
        if direction != "causal":
            raise UnsupportedModelError(
                f"{self.name!r} has {direction} attention. cw_lens implements the causal "
                "(decoder-only) case of P1/P2, where query i reads keys j <= i; use a decoder "
                "such as Llama, Mistral, Qwen or GPT-2."
            )
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"{self.name!r} has {self.n_heads} query heads and {self.n_kv_heads} key/value "
                "heads, which do not form equal groups; cw_lens needs standard multi-head, "
                "multi-query or grouped-query attention."
            )
        if not hasattr(self.model, "blocks"):
            raise UnsupportedModelError(
                f"{self.name!r} exposes no transformer blocks (model.blocks); cw_lens needs a "
                "decoder whose attention TransformerLens hooks (Llama, Mistral, Qwen, GPT-2, ...)."
            )
        missing = [
            hook_name(kind, 0) for kind in ATTENTION_HOOKS if not self.has_hook(hook_name(kind, 0))
        ]
        if missing:
            raise UnsupportedModelError(
                f"{self.name!r} ({self.architecture}) does not expose the attention hooks "
                f"cw_lens needs ({', '.join(missing)}). Contribution weights need a decoder with "
                "standard multi-head / grouped-query attention (Llama, Mistral, Qwen, GPT-2, ...)."
            )

    @cached_property
    def _aliases(self) -> dict[str, str]:
        if self.api != "bridge":
            return {}
        try:
            from transformer_lens.model_bridge.bridge_core import build_alias_to_canonical_map

            return dict(build_alias_to_canonical_map(self.model.hook_dict))
        except Exception:  # older bridges resolve aliases themselves
            return {}

    def has_hook(self, name: str) -> bool:
        # a bridge's hook_dict is rebuilt (with its aliases) on every read: look up once
        if name in self._known_hooks:
            return True
        found = name in self.model.hook_dict or name in self._aliases
        if found:
            self._known_hooks.add(name)
        return found

    def hook_name(self, kind: str, layer: int) -> str:
        """The hook name of `kind` at `layer`; raises when this model lacks it."""
        name = hook_name(kind, layer)
        if not self.has_hook(name):
            raise UnsupportedModelError(
                f"{self.architecture} has no hook {name!r}; the analysis that needs it cannot "
                "run on this model."
            )
        return name

    # ----------------------------------------------------------------- weights and modules
    def output_weights(self, layer: int) -> LayerWeights:
        """`W_O`, `b_O` and the Gram matrices of `layer` (float32, on the device the weights
        are on, or are brought to when offloaded:
        [`resident_weights`][cw_lens.models.offload.resident_weights]); inside
        `weights_kept`, the copy kept there."""
        kept = self._kept_weights
        if kept is not None and layer in kept:
            return kept[layer]
        attn = self.model.blocks[layer].attn
        try:
            # one walk over the offload hooks both reads the weights and says if they move
            got, offloaded = read_weights_and_placement(attn, ("W_O", "b_O"), root=self.model)
            W_O, b_O = got["W_O"], got["b_O"]
            if W_O is None:
                raise AttributeError("the attention has no W_O")
        except CwLensError:
            raise
        except Exception as exc:  # TransformerLens raises its own types for odd attentions
            raise UnsupportedModelError(
                f"{self.architecture}: blocks[{layer}].attn.W_O cannot be read "
                f"({type(exc).__name__}: {exc}); cw_lens cannot read this model's output "
                "projection per head."
            ) from exc
        if tuple(W_O.shape) != (self.n_heads, self.d_head, self.d_model):
            raise UnsupportedModelError(
                f"{self.architecture}: blocks[{layer}].attn.W_O has shape {tuple(W_O.shape)}, "
                f"expected [{self.n_heads}, {self.d_head}, {self.d_model}] (head, d_head, "
                "d_model); cw_lens cannot read this model's output projection per head."
            )
        weights = LayerWeights.from_weights(W_O, b_O, offloaded=offloaded)
        if kept is not None and not offloaded:  # an offloaded layer's copy is read again
            kept[layer] = weights
        return weights

    @contextmanager
    def weights_kept(self, store: dict[int, LayerWeights]) -> Iterator[None]:
        """Within: `output_weights` serves the layers in `store` from it and keeps there
        what it reads (not an offloaded layer's copy), so passes after the first skip reading
        `W_O` and making the Gram matrices.

        For a caller that holds the parameters fixed between its passes and checks that they
        are (the live widget's `cw_lens.interactive.resume.CleanStream`).

        Args:
            store: `{layer: LayerWeights}`, kept by the caller.

        Yields:
            Nothing; the store is in use until the context ends.
        """
        previous, self._kept_weights = self._kept_weights, store
        try:
            yield
        finally:
            self._kept_weights = previous

    def attention_weights(self, layer: int, names: Sequence[str]) -> dict[str, Tensor | None]:
        """The attention weights `names` of `layer` (`"W_V"`, `"W_O"`, `"b_V"`, ..., as
        TransformerLens names them), read through
        [`resident_weights`][cw_lens.models.offload.resident_weights]: detached, `None` where
        the model has none. Raises what the model's attribute raises."""
        return read_weights(self.model.blocks[layer].attn, names, root=self.model)

    def attention_module(self, layer: int) -> torch.nn.Module:
        """The attention module of `layer`: its output (or `output[0]`) is what the block
        adds to the residual stream, before any post-attention norm or residual multiplier.
        Edits of the attention-output route act on it."""
        return self.model.blocks[layer].attn

    def output_projection(self, layer: int) -> torch.nn.Module:
        """The module whose output is exactly `sum_h z^h W_O^h + b_O` of `layer`: the
        bridge's output-projection component (Bloom's attention adds the residual after it),
        the attention module of a HookedTransformer."""
        attn = self.attention_module(layer)
        projection = getattr(attn, "o", None) if self.api == "bridge" else None
        return projection if isinstance(projection, torch.nn.Module) else attn

    def edits_at(self, layer: int) -> list[AttentionEdit]:
        """The entered interventions' edits of `layer`, in the order they were entered."""
        return [edit for edit in self.active_edits if edit.layer == layer]

    def parameter_dtype(self) -> torch.dtype:
        return next(self.attention_module(0).parameters()).dtype

    # ----------------------------------------------------------------- running
    def forward(self, tokens: Tensor) -> Tensor:
        """Logits of right-padded `tokens`.

        No attention mask is passed: with padding only at the end of a row, causal attention
        never lets a real position see padding, so real positions get exactly the values they
        would get alone (padded positions are never read). Passing a mask is also what some
        bridges get wrong (OpenAI-GPT's then drops causality).
        """
        return self.model(tokens)

    def probe_forward(self, tokens: Tensor) -> Tensor:
        """`forward`, with a failure inside TransformerLens reported as unsupported (a hook's
        `StreamDone`, which ends a pass on purpose, passes through)."""
        try:
            return self.forward(tokens)
        except (CwLensError, StreamDone):
            raise
        except Exception as exc:
            raise UnsupportedModelError(
                f"{self.architecture}: a forward pass through this "
                f"{type(self.model).__name__} fails ({type(exc).__name__}: {exc}); "
                "TransformerLens cannot run this architecture, so cw_lens cannot analyse it."
            ) from exc

    def hooks(self, fwd_hooks: Sequence[tuple[str, Callable]]) -> Any:
        """Context manager that adds TransformerLens forward hooks for its duration."""
        return self.model.hooks(fwd_hooks=list(fwd_hooks))

    @contextmanager
    def module_hooks(self, hooks: Sequence[tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
        """Context manager that adds PyTorch forward hooks `fn(module, args, output)`."""
        handles = [module.register_forward_hook(fn) for module, fn in hooks]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @cached_property
    def hook_order(self) -> dict[int, tuple[str, ...]]:
        """Per layer, the order in which `hook_pattern`, `hook_v` and `hook_z` fire (one
        probe pass of four tokens)."""
        order: dict[int, list[str]] = {layer: [] for layer in range(self.n_layers)}
        hooks = []
        for layer in range(self.n_layers):
            for kind in ATTENTION_HOOKS:

                def record(t: Tensor, hook: Any, layer: int = layer, kind: str = kind) -> None:
                    order[layer].append(kind)

                hooks.append((self.hook_name(kind, layer), record))
        tokens = probe_tokens(self, 1, 4)
        with torch.inference_mode(), self.hooks(hooks):
            self.probe_forward(tokens)
        return self._checked_hook_order(order)

    def _checked_hook_order(self, order: dict[int, list[str]]) -> dict[int, tuple[str, ...]]:
        bad = [
            layer for layer, kinds in order.items() if sorted(set(kinds)) != sorted(ATTENTION_HOOKS)
        ]
        if bad:
            raise UnsupportedModelError(
                f"{self.architecture}: at layer {bad[0]} the hooks {', '.join(ATTENTION_HOOKS)} "
                f"did not all fire in a forward pass (fired: {order[bad[0]]}); cw_lens cannot "
                "read this model's attention."
            )
        return {layer: tuple(dict.fromkeys(kinds)) for layer, kinds in order.items()}

    def note_hook_order(self, order: dict[int, list[str]]) -> None:
        """Set [`hook_order`][cw_lens.models.access.ModelAccess.hook_order] from a full pass
        that recorded the three hooks of every layer (verification's probe), sparing its own
        probe pass (on a layer-streamed model, a sweep of the weights).

        Args:
            order: Per layer, the hook kinds in the order they fired.
        """
        if "hook_order" not in self.__dict__ and set(order) == set(range(self.n_layers)):
            self.__dict__["hook_order"] = self._checked_hook_order(order)

    @cached_property
    def route(self) -> Route:
        """`"hook_z"` when `hook_pattern` and `hook_v` fire before `hook_z` in every
        layer (pattern-dependent edits act on `z`), else `"attention output"`."""
        for kinds in self.hook_order.values():
            if kinds.index("z") < max(kinds.index("pattern"), kinds.index("values")):
                return "attention output"
        return "hook_z"


_ACCESS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_access(model: Any) -> ModelAccess:
    """The `ModelAccess` of `model` (one per model object, kept while it lives)."""
    if isinstance(model, ModelAccess):
        return model
    check_model(model)
    try:
        access = _ACCESS.get(model)
    except TypeError:  # not weak-referenceable: not a torch module, so not a TL model
        access = None
    if access is None:
        access = ModelAccess(model)
        _ACCESS[model] = access
    return access


def probe_tokens(access: ModelAccess, batch: int, length: int, seed: int = 0) -> Tensor:
    """Seeded random token ids `[batch, length]` for probe passes (BOS first when known)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = access.d_vocab or 256
    tokens = torch.randint(0, vocab, (batch, length), generator=gen, device="cpu")
    tok = access.tokenizer
    bos = getattr(tok, "bos_token_id", None) if tok is not None else None
    if bos is not None and bos < vocab:
        tokens[:, 0] = bos
    return tokens.to(access.device)


def model_device(model: Any) -> torch.device:
    """The device a model's inputs go to.

    Args:
        model: A TransformerLens model.

    Returns:
        `cfg.device`, or, where TransformerLens read `meta` from an offloaded first weight, the
        device `accelerate`'s hooks compute on.
    """
    device = torch.device(getattr(model.cfg, "device", None) or "cpu")
    if device.type == "meta":
        return execution_device(model)
    return device
