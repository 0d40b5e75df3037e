"""The main job's causal analyses (faithfulness, pruning) run on a seeded random sample of the
corpus windows, never its first windows (the start of the text), and the run records it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from cw_lens.data.documents import Corpus, Document
from cw_lens.reproduction.provenance import causal_sample_markdown, causal_sample_record
from cw_lens.reproduction.run_replicates import RunReplicates, pack, unpack
from cw_lens.reproduction.state import Job, JobConfig, causal_indices, causal_samples


def windows(n: int) -> Corpus:
    """`n` windows sorted by offset, as `load_corpus` returns them."""
    docs = [Document(f"w{i}", (i + 1,), meta={"offset": 100 * i}) for i in range(n)]
    return Corpus("pydoc", docs, max_tokens=1)


def job_on(corpus: Corpus, tmp_path, **settings) -> Job:
    job = Job(JobConfig(**settings), tmp_path, progress=False)
    job.corpus = corpus
    return job


def test_the_sample_is_seeded_random_without_replacement_and_not_a_prefix():
    first = causal_indices(20, 5, seed=0)
    assert first == causal_indices(20, 5, seed=0)  # deterministic for a seed
    assert first != list(range(5)) and first == sorted(set(first)) and len(first) == 5
    assert causal_indices(20, 5, seed=1) != first
    # over many seeds every window is drawn about equally often (5/20 of the draws); a prefix,
    # or any draw favouring the start of the text, piles up on the low positions
    draws = Counter(i for seed in range(400) for i in causal_indices(20, 5, seed))
    assert set(draws) == set(range(20))
    assert all(60 <= draws[i] <= 140 for i in range(20)), draws  # expected 100, sd 8.7
    assert len({tuple(causal_indices(20, 5, seed)) for seed in range(400)}) > 350
    # nested: one permutation per seed, a smaller count within a larger one
    for seed in range(20):
        small, large = causal_indices(50, 8, seed), causal_indices(50, 32, seed)
        assert set(small) <= set(large) and len(large) == 32
    # no count, or one covering the corpus: every window, in order
    for n in (None, 0, 20, 25):
        assert causal_indices(20, n, seed=3) == list(range(20))


def test_equal_counts_share_one_sample_and_lone_costs_lie_within_pruning(tmp_path):
    job = job_on(windows(20), tmp_path, faithfulness_docs=6, pruning_docs=6, lone_docs=2)
    samples = causal_samples(job)
    assert samples["faithfulness"] == samples["pruning"] == causal_indices(20, 6, 0)
    assert set(samples["lone_costs"]) <= set(samples["pruning"])
    assert len(samples["lone_costs"]) == 2 and samples["lone_costs"] != [0, 1]
    job = job_on(windows(20), tmp_path, pruning_docs=4, lone_docs=9, causal_seed=5)
    samples = causal_samples(job)
    assert samples["faithfulness"] == list(range(20))  # faithfulness_docs not set
    assert samples["lone_costs"] == samples["pruning"] == causal_indices(20, 4, 5)


def test_the_causal_seed_is_part_of_the_fingerprint():
    assert JobConfig(causal_seed=1).fingerprint() != JobConfig().fingerprint()
    assert JobConfig(causal_seed=1).fingerprint() == JobConfig(causal_seed=1).fingerprint()


def test_the_causal_steps_receive_exactly_the_sampled_documents(tmp_path, monkeypatch):
    import cw_lens.analyses.faithfulness as faithfulness_module
    import cw_lens.analyses.pruning as pruning_module
    from cw_lens.reproduction.steps import step_faithfulness, step_pruning

    seen: dict[str, list] = {"faithfulness": [], "pruning": []}

    def fake_faithfulness(model, corpus, **kwargs):
        seen["faithfulness"].append(corpus)
        return "faithfulness result"

    def fake_prune(model, corpus, **kwargs):
        seen["pruning"].append((corpus, kwargs.get("lone_corpus"), kwargs.get("lone_docs")))
        return "pruning result"

    monkeypatch.setattr(faithfulness_module, "faithfulness", fake_faithfulness)
    monkeypatch.setattr(pruning_module, "prune_heads", fake_prune)
    corpus = windows(20)
    job = job_on(
        corpus, tmp_path, faithfulness_docs=5, pruning_docs=5, lone_docs=2, global_ranking=True
    )
    assert step_faithfulness(job) == {"result": "faithfulness result"}
    step_pruning(job)
    sample = causal_indices(20, 5, seed=0)
    [given] = seen["faithfulness"]
    assert given.documents == [corpus[i] for i in sample] and given.name == corpus.name
    assert len(seen["pruning"]) == 2  # the layer ranking, then the global variant
    for pruned, _, _ in seen["pruning"]:
        assert pruned.documents == given.documents  # equal counts: the same documents
    _, lone, lone_docs = seen["pruning"][0]
    lone_sample = causal_samples(job)["lone_costs"]
    assert lone.documents == [corpus[i] for i in lone_sample] and lone_docs == 2
    assert set(lone_sample) <= set(sample)
    # another seed, other documents
    seen["faithfulness"].clear()
    step_faithfulness(job_on(corpus, tmp_path, faithfulness_docs=5, causal_seed=1))
    assert seen["faithfulness"][0].documents != given.documents


@pytest.mark.slow
def test_pruning_cross_fits_on_the_halves_of_the_sample(tmp_path, monkeypatch, llama):
    """The cross-fitted rankings are learnt on the sampled documents' even and odd halves,
    not on halves of the corpus's first windows."""
    import cw_lens
    from cw_lens.analyses.pruning import passes
    from cw_lens.reproduction.steps import step_pruning

    halves = []
    learn = passes._head_statistics

    def spy(model, docs, *args):
        halves.append([d.meta["offset"] for d in docs])
        return learn(model, docs, *args)

    monkeypatch.setattr(passes, "_head_statistics", spy)
    corpus = cw_lens.load_corpus(n_docs=10, max_tokens=12, model=llama)
    job = job_on(corpus, tmp_path, pruning_docs=4, lone_docs=1, pruning_draws=1)
    job.config.global_ranking = False
    job.model = llama
    result = step_pruning(job)["result"]
    offsets = [corpus[i].meta["offset"] for i in causal_indices(10, 4, seed=0)]
    assert halves == [offsets[0::2], offsets[1::2]]
    assert result.n_documents == 4 and result.lone_shape[0] == 1


def test_the_record_and_its_report_line():
    corpus = windows(20)
    samples = {"faithfulness": causal_indices(20, 5, 0), "pruning": causal_indices(20, 5, 0)}
    record = causal_sample_record(corpus, samples, seed=0)
    assert record["seed"] == 0 and record["corpus_documents"] == 20
    assert record["pruning"] == {
        "n_documents": 5,
        "corpus_indices": samples["pruning"],
        "offsets": [100 * i for i in samples["pruning"]],
    }
    json.dumps(record)  # JSON-ready
    unwindowed = Corpus("texts", [Document("a"), Document("b"), Document("c")])
    assert (
        "offsets"
        not in causal_sample_record(unwindowed, {"faithfulness": [0, 2]}, 0)["faithfulness"]
    )
    [line, blank] = causal_sample_markdown(record)
    assert blank == "" and "drawn at random (causal seed 0)" in line
    assert "from the corpus's 20 windows" in line and "`pruning_signal` on 5" in line
    assert causal_sample_markdown(None) == []  # a summary written before the record
    # the field comparison's sample is listed after pruning's lone-head costs, which keep theirs
    samples |= {"lone_costs": causal_indices(20, 2, 0), "field": causal_indices(20, 8, 0)}
    [line, _] = causal_sample_markdown(causal_sample_record(corpus, samples, seed=0))
    assert (
        "pruning's lone-head costs on 2 of pruning's and `contribution_vs_field_pairs` on 8;"
        in line
    )


def test_the_field_comparison_has_a_sample_only_when_it_runs(tmp_path):
    """`field_docs` 0 (quick, paper): no `field` sample, so the causal record is as before;
    with it, its own nested draw."""
    assert "field" not in causal_samples(job_on(windows(20), tmp_path))
    job = job_on(windows(20), tmp_path, field_docs=5)
    assert causal_samples(job)["field"] == causal_indices(20, 5, 0)


def test_replicates_pair_causal_claims_only_on_the_same_sample(tmp_path):
    """Two runs over the same corpus pair a causal claim's replicates only when they resampled
    the same sample: another causal seed, or a run that took the first windows, does not."""
    import numpy as np

    documents = [f"h{i}" for i in range(8)]
    boot = {"resamples": 2000, "seed": 0}
    numbers = {("faithfulness_order", "x"): np.zeros(2000)}

    def run(name: str, sample: list[int] | None) -> RunReplicates:
        per_claim = {"faithfulness_order": 3}
        sampled = None if sample is None else {"faithfulness_order": sample}
        path = tmp_path / f"{name}.npz"
        path.write_bytes(pack(numbers, documents, per_claim, boot, claim_documents=sampled))
        return unpack(path, None)

    seed0, again, seed1 = run("a", [1, 4, 6]), run("b", [1, 4, 6]), run("c", [0, 4, 7])
    first = run("old", None)  # written before the sample was recorded: the first documents
    assert seed0.resampled("faithfulness_order") == ["h1", "h4", "h6"]
    assert first.claim_documents == {} and first.resampled("faithfulness_order") == documents[:3]
    assert seed0.pairs_with(again, "faithfulness_order")
    assert not seed0.pairs_with(seed1, "faithfulness_order")
    assert not seed0.pairs_with(first, "faithfulness_order")
    assert first.pairs_with(run("old2", None), "faithfulness_order")


@pytest.mark.slow
def test_a_run_records_its_sample_in_summary_and_report(tmp_path):
    from cw_lens.reproduction.job import run_figures
    from cw_lens.reproduction.run_replicates import unpack as read_replicates

    config = JobConfig(
        model="testing:tiny-llama",
        n_docs=8,
        max_tokens=16,
        task=None,
        batch_size=4,
        faithfulness_docs=3,
        pruning_docs=3,
        causal_seed=2,
        global_ranking=False,
    )
    out = tmp_path / "run"
    summary = run_figures(config, out, progress=False, steps=["faithfulness", "pruning"])
    written = json.loads((out / "summary.json").read_text())
    record = written["causal_sample"]
    sample = causal_indices(8, 3, seed=2)
    assert record["seed"] == 2 and record["corpus_documents"] == 8
    for part in ("faithfulness", "pruning"):
        assert record[part]["corpus_indices"] == sample and record[part]["n_documents"] == 3
        assert len(record[part]["offsets"]) == 3
    assert set(record["lone_costs"]["corpus_indices"]) <= set(sample)
    assert summary["causal_sample"] == record
    report = (out / "REPORT.md").read_text()
    assert "The causal claims rest on windows drawn at random (causal seed 2)" in report
    kept = written["replicates"]
    reps = read_replicates(out / kept["file"], kept["sha256"])
    assert reps.claim_documents == {"faithfulness_order": sample, "pruning_signal": sample}
    assert reps.documents_per_claim["faithfulness_order"] == 3
    # a run without a causal step records no sample
    other = run_figures(config, tmp_path / "sinks", progress=False, steps=["sinks"])
    assert "causal_sample" not in other
