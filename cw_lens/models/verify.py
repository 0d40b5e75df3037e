"""Verifying that a model's hooks show what its attention computes, before any number is returned.

Contribution weights are only valid when the captured hooks satisfy (docs/methods.md#notation), per
layer and head::

    pattern @ v == z                               (GQA mapped: head h reads kv head h // (H/H_kv))
    sum_h z^h W_O^h + b_O == the attention's real output (before any post-norm or multiplier)

:func:`verify_model` runs a short seeded probe (2 sequences x 16 random tokens) and checks both
identities on every layer — the real output is read with a PyTorch forward hook on the attention
module (``model.blocks[l].attn``), not from ``hook_attn_out``. On a ``TransformerBridge`` it also
runs the wrapped Hugging Face model with every bridge component swapped back for the original
module (no TransformerLens code in the pass) and compares the logits, so a bridge that computes
an architecture wrongly is caught even when its hooks agree with each other. It refuses models
whose values are clamped after ``hook_v`` (OLMo's ``clip_qkv``). Then it checks every
intervention on one layer: under it, the attention module's output must equal
``(z - delta) W_O + b_O`` with the exact edit ``delta`` computed independently from the clean
probe (``patch_sink``, ``mask_attention``, ``remove_heads``). Last, the hooks the flow analyses
read (:func:`cw_lens.models.blocks.run_blocks`: ``hook_resid_pre``, ``hook_attn_out``,
``hook_resid_mid``, ``hook_mlp_out``, ``hook_resid_post``) must all fire on the probe and add up
(the block checks of :mod:`cw_lens.models.blocks`); a model that fails them keeps its
contribution weights but its flow analyses are refused (``report.flow``,
:func:`require_flow`).

Every analysis calls :func:`require_verified` first (the result is cached per model), so a model
that fails gets :class:`~cw_lens.core.errors.UnsupportedModelError` naming the architecture, the
layer, the failed identity and the size of the error — never a number.

Example::

    import cw_lens
    report = cw_lens.verify_model(cw_lens.load_model())
    report.ok, report.route, report.interventions, report.flow
    report.to_dataframe()          # one row per layer: relative errors of both identities
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from cw_lens.core.deprecation import renamed_classes
from cw_lens.core.errors import UnsupportedModelError
from cw_lens.core.geometry import grouped_scores_values
from cw_lens.core.results import Result
from cw_lens.models.access import ModelAccess, model_access, probe_tokens
from cw_lens.models.batch import TokenBatch
from cw_lens.models.blocks import run_blocks
from cw_lens.models.edits import HeadRemoval, PairMask, SinkPatch, head_removal_hooks, realise

# relative errors allowed: (identities, logits) by parameter dtype
# (float64 models: the edits and checks of interventions run in float32 -> about 1e-7)
TOLERANCES = {torch.float64: (1e-6, 1e-6), torch.float32: (1e-4, 1e-3)}
HALF_PRECISION_TOLERANCES = (3e-2, 5e-2)
PROBE_BATCH, PROBE_LENGTH = 2, 16
INTERVENTIONS = ("patch_sink", "mask_attention", "remove_heads")


@dataclass(repr=False)
class ModelVerificationResult(Result):
    """What :func:`verify_model` found.

    Attributes:
        architecture, api, dtype: The model.
        route: ``"hook_z"`` or ``"attention output"`` (where pattern-dependent interventions act).
        layers: One row per layer: ``pattern_v_z`` and ``output`` (relative errors of the two
            identities) and the hook firing order.
        logits_vs_hf: Relative error of the bridge's logits against the unbridged Hugging Face
            model (``None`` for a HookedTransformer).
        interventions: ``{name: "exact (...)" | "refused: why"}``.
        flow: ``"exact (...)"`` or ``"refused: why"`` for the flow analyses (residual shares,
            rollout, routes), which read the residual-stream hooks.
        problems: Why the model is refused (empty when ``ok``).
        warnings: What the user should know (e.g. processed weights).
        tolerances: ``(identities, logits)`` relative tolerances used.
    """

    architecture: str
    api: str
    dtype: str
    route: str
    layers: pd.DataFrame
    logits_vs_hf: float | None
    interventions: dict[str, str]
    flow: str = ""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tolerances: tuple[float, float] = (1e-4, 1e-3)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dataframe(self) -> pd.DataFrame:
        return self.layers

    def raise_if_failed(self) -> None:
        if self.problems:
            more = (
                f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            )
            raise UnsupportedModelError(
                f"cw_lens cannot analyse this {self.architecture} model: {self.problems[0]}{more}. "
                "cw_lens.verify_model(model) lists every check."
            )

    def summary_dict(self) -> dict[str, Any]:
        """The verdict and the largest errors (``summary()``: this as a one-row DataFrame;
        ``summary_text()`` / ``str()``: the readable report)."""
        return {
            "architecture": self.architecture,
            "api": self.api,
            "dtype": self.dtype,
            "ok": self.ok,
            "max_error_pattern_v_z": float(self.layers["pattern_v_z"].max()),
            "max_error_output": float(self.layers["output"].max()),
            "logits_vs_hf": self.logits_vs_hf,
            "route": self.route,
            "n_problems": len(self.problems),
        }

    def summary_text(self) -> str:
        lines = [
            f"{self.architecture} ({self.api}, {self.dtype}): "
            + ("verified" if self.ok else "REFUSED"),
            f"  pattern @ v == z: max relative error {self.layers['pattern_v_z'].max():.2g}",
            f"  sum_h z W_O + b_O == attention output: max relative error "
            f"{self.layers['output'].max():.2g}",
        ]
        if self.logits_vs_hf is not None:
            lines.append(
                f"  logits vs the Hugging Face model: relative error {self.logits_vs_hf:.2g}"
            )
        lines.append(f"  interventions act on: {self.route}")
        lines += [f"  {name}: {verdict}" for name, verdict in self.interventions.items()]
        lines.append(f"  flow analyses: {self.flow}")
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    __str__ = summary_text

    def _repr_markdown_(self) -> str:
        return "```\n" + self.summary_text() + "\n```"


def _relative(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def _first(output: Any) -> Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def unbridged(hf_model: torch.nn.Module) -> Iterator[int]:
    """Swap every TransformerLens bridge component inside ``hf_model`` back for its original
    Hugging Face module for the duration (restored on exit); yields how many were swapped."""
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
        yield len(swaps)
    finally:
        for module, name, child in reversed(swaps):
            module._modules[name] = child


def _capture(access: ModelAccess, tokens: Tensor, hooks: Any = ()) -> tuple[dict, Tensor]:
    """One probe pass: per layer pattern, values, z (hooks) and the attention module's output."""
    got: dict[int, dict[str, Tensor]] = {layer: {} for layer in range(access.n_layers)}
    tl_hooks = []
    module_hooks = []
    for layer in range(access.n_layers):
        for kind in ("pattern", "values", "z"):

            def keep(t: Tensor, hook: Any, layer: int = layer, kind: str = kind) -> None:
                got[layer][kind] = t.detach().clone()

            tl_hooks.append((access.hook_name(kind, layer), keep))

        def keeper(name: str, layer: int = layer) -> Any:
            def keep_out(module: Any, args: Any, output: Any) -> None:
                got[layer][name] = _first(output).detach().clone()

            return keep_out

        module_hooks.append((access.output_projection(layer), keeper("out")))
        module_hooks.append((access.attention_module(layer), keeper("attention")))
    with torch.inference_mode():
        with _entered(hooks), access.hooks(tl_hooks), access.module_hooks(module_hooks):
            logits = access.probe_forward(tokens)
    missing = [
        (layer, kind) for layer, g in got.items() for kind in ("out", "attention") if kind not in g
    ]
    if missing:
        raise UnsupportedModelError(
            f"{access.architecture}: the attention module of layer {missing[0][0]} did not run "
            "in a forward pass; cw_lens cannot read this model's attention output."
        )
    return got, logits


@contextmanager
def _entered(hook_set: Any) -> Iterator[None]:
    if hook_set:
        with hook_set:
            yield
    else:
        yield


def _identities(access: ModelAccess, got: dict) -> pd.DataFrame:
    rows = []
    for layer in range(access.n_layers):
        g = got[layer]
        w = access.output_weights(layer).to(g["z"].device)
        mixed = grouped_scores_values(g["pattern"].double(), g["values"].double())
        out = torch.einsum("bphd,hdm->bpm", g["z"].double(), w.W_O.double())
        if w.b_O is not None:
            out = out + w.b_O.double()
        rows.append(
            {
                "layer": layer,
                "pattern_v_z": _relative(mixed, g["z"]),
                "output": _relative(out, g["out"]),
                "hook_order": " < ".join(access.hook_order[layer]),
            }
        )
    return pd.DataFrame(rows)


def _check_interventions(
    access: ModelAccess, tokens: Tensor, clean: dict, tol: float
) -> dict[str, str]:
    """Each intervention on one layer: the attention module's output under it must differ from
    the clean one by exactly ``-delta W_O``, with ``delta`` computed independently from the
    clean probe (the edit of ``z`` the intervention stands for)."""
    model = access.model
    layer = access.n_layers // 2
    g = clean[layer]
    pattern, values, z = g["pattern"].float(), g["values"].float(), g["z"].float()
    w = access.output_weights(layer).to(z.device)
    gen = torch.Generator().manual_seed(1)
    n = pattern.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    remove = (torch.rand(pattern.shape, generator=gen) < 0.25) & causal
    all_heads = list(range(access.n_heads))
    edits = {
        "patch_sink": SinkPatch(layer, all_heads, access.n_heads, 0.0, "scale", [0], None, None),
        "mask_attention": PairMask(layer, remove.to(pattern.device)),
        "remove_heads": HeadRemoval(layer, [0]),
    }
    verdicts: dict[str, str] = {}
    for name, edit in edits.items():
        if isinstance(edit, HeadRemoval):
            hook_set, route = head_removal_hooks(model, [edit], "probe"), "hook_z"
        else:
            hook_set, route = realise(model, [edit], f"probe {name}"), access.route
        got, _ = _capture(access, tokens, hook_set)
        change = torch.einsum("bphd,hdm->bpm", edit.delta(pattern, values).double(), w.W_O.double())
        clean_out = g["attention"].double()
        err = float((got[layer]["attention"].double() - clean_out + change).norm()) / max(
            float(clean_out.norm()), 1e-30
        )
        verdicts[name] = (
            f"exact ({route})"
            if err <= tol
            else f"refused: under it the attention output differs from the exact edit "
            f"(relative error {err:.2g}, tolerance {tol:g})"
        )
    return verdicts


def _check_flow(access: ModelAccess, tokens: Tensor) -> str:
    """The flow analyses' hooks on the probe: every block delivered and checked."""
    n_batch, n_pos = tokens.shape
    mask = torch.ones(n_batch, n_pos, dtype=torch.bool, device=tokens.device)
    batch = TokenBatch(tokens, mask, False, None, list(range(n_batch)))
    kinds: set[str] = set()

    def note(block: Any) -> None:
        kinds.add("sequential" if block.resid_mid is not None else "parallel")
        if block.attn_map.gain is not None:
            kinds.add("post-norm linearised")

    try:
        run_blocks(access.model, batch, note, layers=list(range(access.n_layers)))
    except UnsupportedModelError as err:
        return f"refused: {err}"
    return f"exact ({', '.join(sorted(kinds))} blocks)"


def _config_problems(access: ModelAccess) -> list[str]:
    clip = getattr(access.hf_config, "clip_qkv", None)
    if clip is not None:
        return [
            f"values are clamped to ±{clip} (clip_qkv) inside the attention, after hook_v, so "
            "hook_v is not what the model attends over"
        ]
    return []


def _weight_warnings(access: ModelAccess) -> list[str]:
    try:
        from cw_lens.models.weight_processing import processing_warnings
    except ImportError:  # pragma: no cover - the module ships with cw_lens
        return []
    return list(processing_warnings(access.model))


_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def verify_model(model: Any, *, force: bool = False) -> ModelVerificationResult:
    """Check that cw_lens's numbers are exact on ``model`` (see the module docstring).

    The result is cached per model object; ``force=True`` re-runs the checks (after you change
    the model's weights, say).
    """
    cached = _VERIFIED.get(model) if not force else None
    if cached is not None:
        return cached
    access = model_access(model)
    dtype = access.parameter_dtype()
    tol, tol_logits = TOLERANCES.get(dtype, HALF_PRECISION_TOLERANCES)
    problems = _config_problems(access)
    length = min(PROBE_LENGTH, access.n_ctx or PROBE_LENGTH)
    tokens = probe_tokens(access, PROBE_BATCH, length)
    clean, logits = _capture(access, tokens)
    layers = _identities(access, clean)
    for row in layers.itertuples():
        if row.pattern_v_z > tol:
            problems.append(
                f"layer {row.layer}: pattern @ v != z (relative error {row.pattern_v_z:.2g}, "
                f"tolerance {tol:g}) — hook_v is not the value the attention averages"
            )
            break
    for row in layers.itertuples():
        if row.output > tol:
            problems.append(
                f"layer {row.layer}: sum_h z W_O + b_O != the attention output (relative error "
                f"{row.output:.2g}, tolerance {tol:g}) — W_O/b_O do not describe the attention's "
                "output projection"
            )
            break
    logits_vs_hf = None
    if access.api == "bridge":
        hf_model = access.model.original_model
        with torch.inference_mode(), unbridged(hf_model):
            hf_logits = hf_model(tokens).logits
        logits_vs_hf = _relative(logits.float(), hf_logits.float())
        if logits_vs_hf > tol_logits:
            problems.append(
                f"the bridge's logits differ from the Hugging Face model's (relative error "
                f"{logits_vs_hf:.2g}, tolerance {tol_logits:g}): TransformerLens computes this "
                "architecture differently from Hugging Face, so every number would be wrong"
            )
    if problems:
        interventions = {name: "refused: the model failed verification" for name in INTERVENTIONS}
        flow = "refused: the model failed verification"
    else:
        interventions = _check_interventions(access, tokens, clean, tol)
        flow = _check_flow(access, tokens)
    result = ModelVerificationResult(
        architecture=access.architecture,
        api=access.api,
        dtype=str(dtype).replace("torch.", ""),
        route=access.route,
        layers=layers,
        logits_vs_hf=logits_vs_hf,
        interventions=interventions,
        flow=flow,
        problems=problems,
        warnings=_weight_warnings(access),
        tolerances=(tol, tol_logits),
    )
    _VERIFIED[model] = result
    if result.warnings:
        import warnings

        for message in result.warnings:
            warnings.warn(message, UserWarning, stacklevel=2)
    return result


def require_verified(model: Any) -> ModelVerificationResult:
    """:func:`verify_model` (cached), raising :class:`UnsupportedModelError` on a failed check."""
    result = verify_model(model)
    result.raise_if_failed()
    return result


def require_flow(model: Any) -> ModelVerificationResult:
    """:func:`require_verified`, and refuse a model whose flow-analysis hooks failed the probe."""
    result = require_verified(model)
    if result.flow.startswith("refused"):
        raise UnsupportedModelError(
            "cw_lens's flow analyses (residual shares, rollout, routes) cannot run on this "
            f"model: {result.flow.removeprefix('refused: ')} Contribution weights and the other "
            "analyses are unaffected."
        )
    return result


# The names of 0.3.0: importing them (or loading a pickle that names them) still works, with a
# DeprecationWarning, until 0.4.
__getattr__ = renamed_classes(__name__, ModelVerification=ModelVerificationResult)
