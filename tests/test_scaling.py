"""Corpus analyses hold state of a fixed size: the bytes every accumulator holds after 8 and
after 64 documents are the same (for the flow analysis, the rollout accumulator after its last
batch), counted from the tensors, arrays and objects held — no timing, so a busy machine cannot
fool it."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

import cw_lens
from cw_lens.analyses import pruning, taxonomy
from cw_lens.analyses.faithfulness import curves as faith
from cw_lens.analyses.selection import geometry
from cw_lens.analyses.sinks import ablation as sinks
from cw_lens.core.memory import state_bytes
from cw_lens.data import scoring
from cw_lens.data.streaming import stream_corpus
from cw_lens.flow import rollout

pytestmark = pytest.mark.slow
WORDS = "the sink holds attention while tokens drift in cones of value space".split()


def _texts(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 9))) for _ in range(n)]


def _recorded(monkeypatch, targets) -> dict[str, list]:
    """Wrap ``module.name`` functions so that every object they return is recorded."""
    seen: dict[str, list] = defaultdict(list)
    for module, name in targets:
        original = getattr(module, name)

        def wrapper(*args, _original=original, _key=f"{module.__name__}.{name}", **kw):
            out = _original(*args, **kw)
            seen[_key].append(out[0] if isinstance(out, tuple) else out)
            return out

        monkeypatch.setattr(module, name, wrapper)
    return seen


def _sink_statistics(model, texts):
    acc = cw_lens.SinkStatisticsAccumulator(model, texts, max_samples=200, min_query=4)
    stats, _ = stream_corpus(model, texts, [acc])
    acc.finish(stats).decomposition()
    return [acc]


ANALYSES = {
    "sink_statistics": (_sink_statistics, []),
    "sink_ablation": (
        lambda m, t: cw_lens.sink_ablation(m, t, effect="total"),
        [(sinks, "SinkAblationAccumulator"), (sinks, "ConeStatistics"), (scoring, "NLLResult")],
    ),
    "selection_geometry": (
        lambda m, t: cw_lens.selection_geometry(m, t, n_grid=[1, 2], progress=False),
        [(geometry, "SelectionGeometryAccumulator")],
    ),
    "head_taxonomy": (
        lambda m, t: cw_lens.head_taxonomy(m, t, progress=False),
        [(taxonomy, "HeadTaxonomyAccumulator")],
    ),
    "faithfulness": (
        lambda m, t: cw_lens.faithfulness(
            m, t, metrics=("attention", "contribution"), fractions=(0.1,), progress=False
        ),
        [(faith, "Outcomes")],
    ),
    "prune_heads": (
        lambda m, t: pruning.prune_heads(
            m,
            t,
            order=("taxonomy", "random"),
            retention=0.5,
            n_random=1,
            lone=False,
            progress=False,
        ),
        [(scoring, "NLLResult"), (taxonomy, "HeadTaxonomyAccumulator")],
    ),
    # the flow analysis: the rollouts of one batch at a time (its records are its result)
    "rollout_deletion": (
        lambda m, t: cw_lens.rollout_deletion(m, t, ks=(1,), n_random=1),
        [(rollout, "RolloutAccumulator")],
    ),
}


@pytest.mark.parametrize("analysis", list(ANALYSES))
def test_accumulator_state_is_the_same_after_8_and_64_documents(analysis, llama, monkeypatch):
    run, targets = ANALYSES[analysis]
    sizes = []
    for n_docs in (8, 64):
        seen = _recorded(monkeypatch, targets)
        out = run(llama, _texts(n_docs))
        accumulators = out if isinstance(out, list) else [a for v in seen.values() for a in v]
        assert accumulators, "no accumulator was recorded"
        sizes.append([state_bytes(a) for a in accumulators])
        monkeypatch.undo()
    assert sizes[0] == sizes[1]
