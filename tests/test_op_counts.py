"""Tensor operations per layer and batch: the counter `benchmarks/bench_ops.py` uses, and bounds.

A count of dispatched ATen operations is the same on every machine, so unlike a time it may be
bounded in a test. On a GPU each operation is a kernel launch, so the count per layer and batch
is what decides whether an analysis is launch-bound. The bounds below are this version's counts
on this file's workload (the tiny Llama, 16 documents of 64 tokens) plus 10%: a change that adds
operations per layer fails here. The selection and the taxonomy are at the goal the benchmark
states (at most 3x the forward pass); the sink statistics, the ablation (two passes) and the four
fused are above it (docs/performance.md says what their operations are).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import cw_lens
from cw_lens.models.testing import tiny_llama

_SCRIPT = Path(__file__).parent.parent / "benchmarks" / "bench_ops.py"


@pytest.fixture(scope="module")
def bench_ops():
    spec = importlib.util.spec_from_file_location("bench_ops", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_counter_counts_each_dispatched_operation_once(bench_ops):
    a, b = torch.ones(3), torch.ones(3)
    counts = bench_ops.count_operations(lambda: (a + b).mul_(2).sum())
    assert dict(counts) == {"add": 1, "mul_": 1, "sum": 1}


# this version's counts per layer and batch over the forward pass's (tiny Llama, 16 documents of
# 64 tokens, batches of 8: 15.0x, 3.0x, 2.9x, 5.3x, 21.4x; one batch of contribution weights
# 4.5x), with 10% to spare
BOUNDS = {"sinks": 16.5, "selection": 3.35, "taxonomy": 3.2, "ablation": 5.85, "fused": 23.5}


@pytest.fixture(scope="module")
def measured(bench_ops):
    torch.manual_seed(0)
    model = tiny_llama()
    corpus = cw_lens.load_corpus(n_docs=16, max_tokens=64, model=model, progress=False)
    with torch.no_grad():
        return bench_ops.measure(model, corpus, cases=tuple(BOUNDS))


@pytest.mark.parametrize("case", BOUNDS)
def test_operations_per_layer_and_batch_stay_within_their_bound(measured, case):
    ratio = measured[case]["ratio"]
    assert ratio <= BOUNDS[case], (
        f"{case} issues {measured[case]['per_layer_batch']:.0f} operations per layer and batch, "
        f"{ratio:.1f}x the forward pass's (bound {BOUNDS[case]}x): its most common are "
        f"{measured[case]['most_common']}"
    )


def test_one_batch_of_contribution_weights_stays_within_its_bound(measured):
    assert measured["contribution_weights"]["ratio"] <= 5.0
