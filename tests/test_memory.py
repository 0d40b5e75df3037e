"""Memory known before the pass: a result over the budget is refused before any forward pass,
with its size and the ways out; the estimate is the size the result really takes."""

from __future__ import annotations

import math

import pytest
import torch

import cw_lens
from cw_lens.core import memory
from cw_lens.core.errors import InputError, MemoryBudgetError
from cw_lens.core.memory import format_bytes, memory_budget, pair_field_bytes, parse_bytes
from cw_lens.models.testing import tiny_llama

TEXTS = ["The quick brown fox.", "Heads look at BOS."]


@pytest.fixture
def fresh():
    """A tiny Llama never verified (verification runs probe passes) and a forward counter."""
    model = tiny_llama(seed=5)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return model, calls


def contribution_bytes(n_batch, n_layers, n_heads, n_pos) -> int:
    return pair_field_bytes(n_batch, n_layers, n_heads, n_pos, pair_fields=6, row_fields=3)


def test_over_the_budget_raises_before_any_forward_pass_and_names_size_and_ways_out(fresh):
    model, calls = fresh
    n_pos = 1 + max(len(t) for t in TEXTS)  # BOS + one byte per character
    size = contribution_bytes(2, 2, 4, n_pos)
    with pytest.raises(MemoryBudgetError) as err:
        cw_lens.contribution_weights(model, TEXTS, memory_budget="10kB")
    assert calls == [], "a forward pass ran before the memory check"
    text = str(err.value)
    assert f"would take {format_bytes(size)}" in text and "10 kB (memory_budget=10kB)" in text
    for way in ("layers=", "heads=", "stream_contributions", "sink_statistics"):
        assert way in text, way
    assert isinstance(err.value, InputError)
    assert cw_lens.MemoryBudgetError is MemoryBudgetError


def test_a_generous_budget_runs_and_changes_nothing(fresh):
    model, calls = fresh
    kept = cw_lens.contribution_weights(model, TEXTS, memory_budget=1e9)
    assert calls
    free = cw_lens.contribution_weights(model, TEXTS, memory_budget="none")
    assert torch.equal(kept.weights.nan_to_num(), free.weights.nan_to_num())


def test_the_estimate_is_what_the_result_takes_with_every_derived_field(fresh):
    model, _ = fresh
    cw = cw_lens.contribution_weights(model, TEXTS, layers=[1], heads=[0, 2])
    fields = [*cw.FIELDS, "projected_value_norm", "output_norm", "head_output_norm"]
    taken = sum(getattr(cw, name).nbytes for name in fields)
    n_batch, n_pos = cw.tokens.shape
    assert taken == contribution_bytes(n_batch, 1, 2, n_pos)


def test_fewer_layers_fit_where_all_do_not(fresh):
    model, _ = fresh
    n_pos = 1 + max(len(t) for t in TEXTS)
    one_layer = contribution_bytes(2, 1, 4, n_pos)
    budget = one_layer + 1
    with pytest.raises(MemoryBudgetError):
        cw_lens.contribution_weights(model, TEXTS, memory_budget=budget)
    assert cw_lens.contribution_weights(model, TEXTS, layers=[0], memory_budget=budget).layers == [
        0
    ]


def test_the_environment_variable_sets_the_budget_and_the_argument_wins(fresh, monkeypatch):
    model, calls = fresh
    monkeypatch.setenv("CW_LENS_MEMORY_BUDGET", "1 KiB")
    with pytest.raises(MemoryBudgetError, match=r"\$CW_LENS_MEMORY_BUDGET=1 KiB"):
        cw_lens.contribution_weights(model, TEXTS)
    assert calls == []
    cw_lens.contribution_weights(model, TEXTS, memory_budget="1GB")


def test_the_default_is_half_the_available_memory(fresh, monkeypatch):
    model, calls = fresh
    monkeypatch.delenv("CW_LENS_MEMORY_BUDGET", raising=False)
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 20_000)
    assert memory_budget("cpu") == (10_000, "50% of the 20 kB available on cpu")
    with pytest.raises(MemoryBudgetError, match="50% of the 20 kB available"):
        cw_lens.contribution_weights(model, TEXTS)
    assert calls == []
    monkeypatch.setattr(memory, "available_memory", lambda device=None: None)
    assert memory_budget("cpu")[0] == math.inf
    cw_lens.contribution_weights(model, TEXTS)


def test_available_memory_answers_on_this_machine():
    assert memory.available_memory("cpu") > 0
    assert memory.available_memory("meta") is None


def test_residual_shares_and_the_sink_patch_comparison_are_guarded_before_any_pass(fresh):
    model, calls = fresh
    with pytest.raises(MemoryBudgetError, match=r"residual shares.*stream_shares"):
        cw_lens.residual_shares(model, TEXTS, memory_budget="1kB")
    n_pos = 1 + len(TEXTS[0])
    one_run = contribution_bytes(1, 1, 4, n_pos)
    with pytest.raises(MemoryBudgetError, match="x 2 runs"):  # clean and patched
        cw_lens.compare_sink_patch(model, TEXTS[0], view_layers=[1], memory_budget=one_run + 1)
    assert calls == []
    cw_lens.compare_sink_patch(model, TEXTS[0], view_layers=[1], memory_budget=2 * one_run)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("8GB", 8e9), ("512 MiB", 2**29), ("1.5gib", 1.5 * 2**30), (2e9, 2e9), (1024, 1024.0),
     ("3e3 kB", 3e6), ("none", math.inf), (math.inf, math.inf)],
)  # fmt: skip
def test_budgets_parse(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["8 parsecs", "-1GB", -5, True, "GB", [8]])
def test_bad_budgets_are_refused(value):
    with pytest.raises(InputError, match="memory budget"):
        parse_bytes(value)
