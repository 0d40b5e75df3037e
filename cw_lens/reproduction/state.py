"""The main job's settings and state: `JobConfig` (and its presets) and `Job`, which stores each
step's result and loads it again on a rerun (the files, their records and digests:
`cw_lens.reproduction.stored_steps`); which documents the causal analyses run on
(`causal_indices`) and how many documents each claim's numbers come from.

The lowest of the reproduction modules but `stored_steps`: `job` (which runs the job), `steps`
(the analyses it runs) and `markdown` (REPORT.md) all read a `Job`, and this module imports
none of them.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cw_lens.core.errors import InputError
from cw_lens.data.distributed import barrier, is_main_process, main_process_decides
from cw_lens.reproduction.stored_steps import (
    MAX_TIMINGS_BYTES,
    MISSING,
    STEP_SUFFIX,
    TIMINGS_FILE,
    atomic_write_bytes,
    load_step,
    recorded_digest,
    refuse_link,
    state_root,
    store_step,
    timings_problem,
    verified_step,
)

MIN_RESAMPLES = 2000  # methods § Claims: a claim interval rests on at least this many resamples


@dataclass
class JobConfig:
    """Everything that decides the numbers of a run (and so its fingerprint)."""

    model: str | None = None
    corpus: str | None = None
    n_docs: int = 8
    max_tokens: int = 128
    seed: int = 0
    batch_size: int = 8
    task: str | None = "ioi"
    task_docs: int = 24
    faithfulness_docs: int | None = None  # documents faithfulness runs on (None: all)
    lone_docs: int = 2  # pruning's lone-head costs: this many of pruning's documents, at random
    device: str | None = None
    dtype: str = "float32"
    api: str = "auto"
    random_draws: int = 1  # draws of faithfulness's random ranking (> 1: their spread)
    n_resamples: int = 2000  # resamples of the claims' intervals (methods § Claims: at least 2,000)
    bootstrap_seed: int = 0  # the bootstrap's own seed, independent of `seed`
    faithfulness_granularity: tuple[str, ...] = ("pairs",)  # the claim's; ("pairs", "tokens")
    pruning_docs: int | None = None  # documents pruning runs on (None: all)
    pruning_draws: int = 3  # random orders; pruning_signal's verdict needs >= 20
    pruning_draws_everywhere: int | None = None  # draws at 50% and 25% too (None: all)
    global_ranking: bool = False  # also prune with one global ranking (the variant)
    # seed of the random sample of corpus windows the causal analyses (faithfulness, pruning and
    # its lone-head costs) run on: `causal_indices`
    causal_seed: int = 0
    # the comparison with other tools' attribution methods (`contribution_vs_field`, the `field`
    # preset): windows of the corpus for the pair-level test (a random sample, `causal_indices`)
    # and items per task corpus (`FIELD_TASKS`) for the input-level test; 0 leaves each out
    field_docs: int = 0
    field_items: int = 0

    def __post_init__(self) -> None:
        if self.n_resamples < MIN_RESAMPLES:
            raise InputError(
                f"n_resamples={self.n_resamples}: a claim interval needs at least "
                f"{MIN_RESAMPLES} bootstrap resamples (docs/methods.md#claims); use --n-resamples "
                f"{MIN_RESAMPLES} or more."
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> JobConfig:
        """The settings of a named preset (`PRESETS`), then `overrides` (`None`
        values leave the preset's)."""
        if name not in PRESETS:
            raise InputError(f"Unknown preset {name!r}; use one of {sorted(PRESETS)}.")
        settings = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
        return cls(**settings)

    def settings(self) -> dict[str, Any]:
        """Every setting that changes what a step computes, and the cw_lens version (`version`).

        The bootstrap (`n_resamples`, `bootstrap_seed`) resamples the stored per-document
        records when the summary is built, so it is not among them: a rerun with another
        bootstrap seed reuses the forward passes. `causal_seed` always is: it decides which
        documents the causal steps run on (pruning's lone-head costs sample `lone_docs` of them
        in every run), and with it a run never resumes steps stored before the causal analyses
        sampled their documents (they ran on the first ones).

        Returns:
            The settings, JSON-ready.
        """
        from cw_lens.models.hooked import resolve_api
        from cw_lens.version import __version__

        skip = ("device", "api", "n_resamples", "bootstrap_seed")
        keys = {k: v for k, v in self.__dict__.items() if k not in skip}
        if self.random_draws == 1:  # the default: the fingerprint is as without the option
            del keys["random_draws"]
        for key in ("field_docs", "field_items"):  # likewise when the comparison is left out
            if not keys[key]:
                del keys[key]
        if resolve_api(self.api) == "hooked":  # a HookedTransformer run never resumes a bridge's
            keys["api"] = "hooked"
        keys["version"] = __version__
        return keys

    def fingerprint(self) -> str:
        """The name of the stored steps' folder: a hash of `settings`.

        Returns:
            12 hex digits.
        """
        blob = json.dumps(self.settings(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# The main job's sizes. `quick` (the default, `make figures`, `JobConfig()`): 8 windows of 128
# tokens of pydoc for every analysis, with the paper preset's choices of what to run
# (faithfulness at pairs granularity, the claim's; no global pruning variant) — its intervals
# are wide and pruning_signal has too few random draws for a verdict. `paper`: the non-causal
# analyses (sinks, ablation, selection, taxonomy) on 256 windows of 256 tokens of
# pydoc+stdlib; the causal ones on 32 of them drawn at random (`causal_seed`; the same 32 for
# both, never the first 32, which would be the start of the text): faithfulness at pairs
# granularity (the claim's), pruning with 20 random orders (3 of them at 50% and 25% too) and
# no global variant; the IOI task on 24 items.
#
# `field`: only the comparison with the attribution methods of other tools
# (`contribution_vs_field`, `PRESET_STEPS`): the pair-level test on 16 windows of 128 tokens of
# pydoc with every pair metric and 3 random draws, the input-level test on 32 items of each task
# corpus of `FIELD_TASKS` that the model answers correctly.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {},
    "field": {"n_docs": 16, "max_tokens": 128, "field_docs": 16, "field_items": 32},
    "paper": {
        "corpus": "pydoc+stdlib",
        "n_docs": 256,
        "max_tokens": 256,
        "faithfulness_docs": 32,
        "faithfulness_granularity": ("pairs",),
        "pruning_docs": 32,
        "pruning_draws": 20,
        "pruning_draws_everywhere": 3,
        "global_ranking": False,
    },
}


# the steps a preset runs when no steps are named (default: every step)
PRESET_STEPS: dict[str, tuple[str, ...]] = {"field": ("field_pairs", "field_inputs")}

# the task corpora of the input-level comparison (`field_items` items of each)
FIELD_TASKS = ("ioi", "arithmetic")


def field_input_claim(task: str) -> str:
    """The id of the input-level comparison's claim on one task corpus (and of its figure).

    Args:
        task: A task corpus of `FIELD_TASKS`.

    Returns:
        `contribution_vs_field_inputs_<task>`.
    """
    return f"contribution_vs_field_inputs_{task}"


def field_input_number(task: str, number: str) -> str:
    """The main job's name of an input-level comparison's number on one task corpus: each
    task's numbers are quantities of their own, with their own coverage (docs/coverage.md).

    Args:
        task: A task corpus of `FIELD_TASKS`.
        number: The number as `claims` of an input deletion result names it (`inputs_...`).

    Returns:
        `inputs_<task>_...`.

    Examples:
        >>> field_input_number("ioi", "inputs_sufficiency_best_other_minus_contribution_rollout")
        'inputs_ioi_sufficiency_best_other_minus_contribution_rollout'
    """
    if not number.startswith("inputs_"):
        raise ValueError(f"{number!r} is not an input-level comparison's number (inputs_...).")
    return f"inputs_{task}_{number.removeprefix('inputs_')}"


@dataclass
class Job:
    """A running job: config, model, corpus, output folder and stored step results."""

    config: JobConfig
    out: Path
    force: bool = False
    progress: bool = True
    model: Any = None
    corpus: Any = None
    results: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    steps: tuple[str, ...] = ()  # the steps this run computes (select_steps)
    # steps computed (and stored) by an earlier step's shared corpus pass, waiting for their turn,
    # and the seconds a running step charges itself when it computed more than its own result
    ahead: dict[str, tuple[Any, float]] = field(default_factory=dict)
    charged: dict[str, float] = field(default_factory=dict)
    # what the steps read besides the settings (the weights' and corpus windows' records), the
    # steps each step reads (`steps.STEP_NEEDS`), and why a loaded step's value is not one of
    # that step's (`steps.stored_value_problem`; None: any value), all set by the main job
    inputs: dict[str, Any] = field(default_factory=dict)
    needs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    check_value: Callable[[str, Any], str | None] | None = None
    # each step's digest (`step_digest`) in this run, loaded or computed
    digests: dict[str, str] = field(default_factory=dict)
    said: set[str] = field(default_factory=set, repr=False)  # notices printed once

    @property
    def state_dir(self) -> Path:
        """`<out>/.state/<fingerprint>`, checked to be no link (`state_root`)."""
        folder = state_root(self.out) / self.config.fingerprint()
        refuse_link(folder, "its stored steps")
        return folder

    def state_file(self, name: str) -> Path:
        """The file `name` of the state folder, checked to be no link.

        Args:
            name: A file name.

        Returns:
            Its path.
        """
        path = self.state_dir / name
        refuse_link(path, "its stored steps")
        return path

    def step_key(self, name: str) -> dict[str, Any]:
        """What step `name` computes from in this run (JSON-ready): the step, the settings
        (with the cw_lens version), the inputs, and the digests of the steps it reads.

        Args:
            name: A step.

        Returns:
            The record a stored step must carry to be loaded.
        """
        key = {
            "step": name,
            "settings": self.config.settings(),
            "inputs": self.inputs,
            "needs": {need: self.digests.get(need) for need in self.needs.get(name, ())},
        }
        return json.loads(json.dumps(key, sort_keys=True))  # tuples as the file has them

    def step(self, name: str, fn: Callable[[Job], Any]) -> Any:
        """Load step `name` if stored for this run (and not forced), else compute and store
        atomically.

        A stored step is a safetensors file in the format of `result.save`
        (`cw_lens.core.saving`): loading it builds only the classes cw_lens registered and runs
        no code from the file. It is loaded only when the record it carries is this run's
        (`step_key`) and its content matches the digest recorded with it (`step_digest`);
        any other file (damaged, copied from another run, edited, written by another version,
        naming a class cw_lens does not read, holding no value of this step) is recomputed with
        a line that says why, never trusted; a step stored as a pickle by cw_lens 0.4.0 or
        earlier is recomputed too.
        """
        if name in self.ahead:  # stored already, by the step whose pass computed it
            self.results[name], self.timings[name] = self.ahead.pop(name)
            self._log(f"[{name}] computed by the shared corpus pass ({self.timings[name]:.1f} s)")
            return self.results[name]
        path = self.state_file(f"{name}{STEP_SUFFIX}")
        stored, digest, why = (MISSING, None, None) if self.force else self._load_step(name)
        # every rank follows rank 0: loading skips the step's collectives, so ranks must agree
        if main_process_decides(stored is not MISSING):
            if stored is MISSING or digest is None:  # rank 0 read the file but this rank cannot
                raise RuntimeError(
                    f"Rank 0 loaded {path} but this rank cannot read it; do all ranks share "
                    "the output folder? Rerun with --force to recompute."
                )
            self.results[name], self.digests[name] = stored, digest
            computed_in = self._stored_timings().get(name)
            if computed_in is not None:  # the time it took when it was computed
                self.timings[name] = computed_in
            self._log(f"[{name}] loaded from {path}")
            return stored
        if why is not None:
            self._notice(f"[{name}] stored result not used ({why}); recomputing")
        elif not self.force and path.with_suffix(".pkl").exists():
            self._notice(
                f"[{name}] a pickled result from an older cw_lens is never loaded (a pickle can "
                "run code); recomputing"
            )
        start = time.perf_counter()
        self._log(f"[{name}] computing")
        value = fn(self)
        self.timings[name] = self.charged.pop(name, time.perf_counter() - start)
        self._store(name, value, self.timings[name])
        self.results[name] = value
        self._log(f"[{name}] done in {self.timings[name]:.1f} s")
        return value

    def _load_step(self, name: str) -> tuple[Any, str | None, str | None]:
        """Stored step `name`: `(value, digest, None)`, or `(MISSING, None, why)` when it is
        not used (`why` None: there is no file)."""
        path = self.state_file(f"{name}{STEP_SUFFIX}")
        value, why = load_step(path, self.step_key(name))
        if value is MISSING:
            return MISSING, None, why
        problem = self.check_value(name, value) if self.check_value is not None else None
        if problem is not None:
            return MISSING, None, f"it holds no value of the step {name!r}: {problem}"
        return value, recorded_digest(path), None

    def _store(self, name: str, value: Any, seconds: float) -> None:
        """Write step `name`'s value and the seconds it took atomically (rank 0)."""
        path = self.state_file(f"{name}{STEP_SUFFIX}")
        if is_main_process():
            store_step(path, value, self.step_key(name))
            timings = {**self._stored_timings(), name: seconds}
            atomic_write_bytes(self.state_file(TIMINGS_FILE), json.dumps(timings).encode())
        barrier()
        # every rank reads the digest rank 0 wrote: the steps reading this one need it
        self.digests[name] = recorded_digest(path)

    def is_stored(self, name: str) -> bool:
        """Whether step `name` has a stored result this run would load (not with `force`).

        Args:
            name: A step.

        Returns:
            True when its file is there and carries this run's record and a matching digest.
        """
        path = self.state_file(f"{name}{STEP_SUFFIX}")
        if self.force or not path.exists():
            return False
        return verified_step(path, self.step_key(name))[0] is not None

    def store_ahead(self, name: str, value: Any, seconds: float) -> None:
        """Store step `name`, computed by the running step's shared pass, at once (a resumed
        run loads it); its own turn then takes it as computed in `seconds`.

        Args:
            name: The step.
            value: What the step stores.
            seconds: The time charged to it.
        """
        self._store(name, value, seconds)
        self.ahead[name] = (value, seconds)

    def _stored_timings(self) -> dict[str, float]:
        """Seconds each stored step took when it was computed (`{}` if none are recorded, or
        if `timings.json` is not such a record: then the run says so, once)."""
        path = self.state_file(TIMINGS_FILE)
        try:
            if path.stat().st_size > MAX_TIMINGS_BYTES:
                raise ValueError(f"over {MAX_TIMINGS_BYTES} bytes")
            timings = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            problem = f"not readable JSON: {str(exc)[:200]}"
        else:
            problem = timings_problem(timings)
            if problem is None:
                return timings
        self._notice(
            f"[timings] {path} not used ({problem}): the loaded steps' compute times are not "
            "reported, and the file is rewritten as steps are stored"
        )
        return {}

    def _log(self, message: str) -> None:
        if self.progress and is_main_process():
            print(message, file=sys.stderr, flush=True)

    def _notice(self, message: str) -> None:
        """Say `message` once (rank 0), even without progress lines: a stored file not used."""
        if message not in self.said and is_main_process():
            self.said.add(message)
            print(message, file=sys.stderr, flush=True)


def causal_indices(n_corpus: int, n: int | None, seed: int) -> list[int]:
    """The positions in a corpus of `n_corpus` documents that a causal analysis asking for `n`
    of them runs on: the first `n` of one seeded random permutation of the positions, sorted
    (the batches keep the corpus's order). The corpus windows are sorted by their offset in
    the text, so its first `n` would be the start of the text, never a sample of it.

    One permutation per seed and corpus size serves every count, so the samples are nested:
    two analyses asking for the same count run on the same documents, a smaller count on part
    of a larger one's.

    Args:
        n_corpus: Documents in the corpus.
        n: Documents wanted; `None` or 0 (not set), or `n_corpus` and more: every position.
        seed: The permutation's seed (`JobConfig.causal_seed`).

    Returns:
        Sorted positions, `min(n, n_corpus)` of them.

    Examples:
        >>> causal_indices(20, 5, seed=0)
        [4, 5, 8, 14, 19]
        >>> causal_indices(20, 8, seed=0)  # the 5 and 3 more
        [4, 5, 8, 9, 11, 13, 14, 19]
        >>> causal_indices(20, 5, seed=1)
        [2, 3, 5, 13, 18]
        >>> causal_indices(5, None, seed=0)
        [0, 1, 2, 3, 4]
    """
    if not n or n >= n_corpus:
        return list(range(n_corpus))
    # A string seed is hashed (SHA-512, the same on every platform and Python version), which
    # keeps this draw apart from the corpus's own window draw, `random.Random(seed)` with the
    # run's seed: the two would otherwise read the same random bits.
    permutation = random.Random(f"cw_lens causal sample {seed}").sample(range(n_corpus), n_corpus)
    return sorted(permutation[:n])


CAUSAL_PARTS = {  # the step that runs each causal sample
    "faithfulness": "faithfulness",
    "pruning": "pruning",
    "lone_costs": "pruning",
    "field": "field_pairs",
}


def causal_samples(job: Job) -> dict[str, list[int]]:
    """The corpus positions each causal part of the job runs on (`causal_indices`):
    `faithfulness` its `faithfulness_docs`, `pruning` its `pruning_docs`, `lone_costs`
    (pruning's lone-head costs) `lone_docs` of pruning's documents, and `field` (the pair-level
    comparison with other tools' metrics) its `field_docs`.

    Args:
        job: The running job (its corpus loaded).

    Returns:
        `{part: sorted positions}` for every part of `CAUSAL_PARTS` (`field` only with
        `field_docs`).
    """
    cfg, n_corpus = job.config, len(job.corpus)
    pruning = causal_indices(n_corpus, cfg.pruning_docs, cfg.causal_seed)
    lone = min(cfg.lone_docs or len(pruning), len(pruning))  # nested: within pruning's
    samples = {
        "faithfulness": causal_indices(n_corpus, cfg.faithfulness_docs, cfg.causal_seed),
        "pruning": pruning,
        "lone_costs": causal_indices(n_corpus, lone, cfg.causal_seed),
    }
    if cfg.field_docs:  # 0: the run has no pair-level comparison
        samples["field"] = causal_indices(n_corpus, cfg.field_docs, cfg.causal_seed)
    return samples


def causal_corpus(job: Job, part: str) -> Any:
    """The documents causal part `part` of the job runs on (`causal_samples`), as a corpus.

    Args:
        job: The running job (its corpus loaded).
        part: `"faithfulness"`, `"pruning"`, `"lone_costs"` or `"field"`.

    Returns:
        A [`Corpus`][cw_lens.Corpus] of those documents, in corpus order.
    """
    return job.corpus.subset(causal_samples(job)[part])


def claim_documents(job: Job, claims: Iterable[str]) -> dict[str, int]:
    """How many documents (or task items) each claim's numbers come from: faithfulness its
    random sample of `faithfulness_docs`, pruning its sample of `pruning_docs`
    (`causal_samples`), the pair-level comparison its `field_docs`, each input-level comparison
    the items of its task (`item_resampled_claims`), every other claim the corpus."""
    n_docs = len(job.corpus)
    wanted = {
        "faithfulness_order": job.config.faithfulness_docs,
        "pruning_signal": job.config.pruning_docs,
        "contribution_vs_field_pairs": job.config.field_docs,
    }
    items = item_resampled_claims(job)
    return {
        cid: items[cid] if cid in items else min(wanted.get(cid) or n_docs, n_docs)
        for cid in claims
    }


def item_resampled_claims(job: Job) -> dict[str, int]:
    """The claims whose numbers resample task items, not corpus documents (the input-level
    comparison on each task of `FIELD_TASKS`), and how many items each has.

    Args:
        job: The running job.

    Returns:
        `{claim id: items}` for the input-level tests the run has.
    """
    ran = job.results.get("field_inputs") or {}
    return {
        field_input_claim(task): len(result.item_aopc().dropna())
        for task, result in ran.items()
        if result is not None
    }
