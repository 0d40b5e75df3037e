"""The main job's settings and state: `JobConfig` (and its presets) and `Job`, which stores each
step's result atomically and loads it again on a rerun; the atomic writes; which documents the
causal analyses run on (`causal_indices`) and how many documents each claim's numbers come from.

The lowest of the reporting modules: `job` (which runs the job), `steps` (the analyses it runs)
and `markdown` (REPORT.md) all read a `Job`, and this module imports none of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cw_lens.core.errors import InputError
from cw_lens.data.distributed import barrier, is_main_process, main_process_decides

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
    faithfulness_granularity: tuple[str, ...] = ("pairs", "tokens")
    pruning_docs: int | None = None  # documents pruning runs on (None: all)
    pruning_draws: int = 3  # random orders; pruning_signal's verdict needs >= 20
    pruning_draws_everywhere: int | None = None  # draws at 50% and 25% too (None: all)
    global_ranking: bool = True  # also prune with one global ranking (the variant)
    # seed of the random sample of corpus windows the causal analyses (faithfulness, pruning and
    # its lone-head costs) run on: `causal_indices`
    causal_seed: int = 0

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

    def fingerprint(self) -> str:
        """The stored steps' key: every setting that changes what a step computes. The
        bootstrap (`n_resamples`, `bootstrap_seed`) resamples the stored per-document
        records when the summary is built, so it is not part of it: a rerun with another
        bootstrap seed reuses the forward passes. `causal_seed` is always part of it: it
        decides which documents the causal steps run on (pruning's lone-head costs sample
        `lone_docs` of them in every run), and with it a run never resumes steps stored
        before the causal analyses sampled their documents (they ran on the first ones)."""
        from cw_lens.models.hooked import resolve_api
        from cw_lens.version import __version__

        skip = ("device", "api", "n_resamples", "bootstrap_seed")
        keys = {k: v for k, v in self.__dict__.items() if k not in skip}
        if self.random_draws == 1:  # the default: the fingerprint is as without the option
            del keys["random_draws"]
        if resolve_api(self.api) == "hooked":  # a HookedTransformer run never resumes a bridge's
            keys["api"] = "hooked"
        keys["version"] = __version__
        blob = json.dumps(keys, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# The main job's sizes. `quick` (the default, `make figures`): 8 windows of 128 tokens of
# pydoc for every analysis — its intervals are wide and pruning_signal has too few random draws
# for a verdict. `paper`: the non-causal analyses (sinks, ablation, selection, taxonomy) on
# 256 windows of 256 tokens of pydoc+stdlib; the causal ones on 32 of them drawn at random
# (`causal_seed`; the same 32 for both, never the first 32, which would be the start of the
# text): faithfulness at pairs granularity (the claim's), pruning with 20 random orders (3 of
# them at 50% and 25% too) and no global variant; the IOI task on 24 items.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {},
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

    @property
    def state_dir(self) -> Path:
        return self.out / ".state" / self.config.fingerprint()

    def step(self, name: str, fn: Callable[[Job], Any]) -> Any:
        """Load step `name` if stored (and not forced), else compute and store atomically.

        A stored step is a safetensors file in the format of `result.save`
        (`cw_lens.core.saving`): loading it builds only the classes cw_lens registered and runs
        no code from the file. A file that does not load (damaged, written by another version,
        naming a class cw_lens does not read) is recomputed with a line that says why, never
        trusted; a step stored as a pickle by cw_lens 0.4.0 or earlier is recomputed too.
        """
        if name in self.ahead:  # stored already, by the step whose pass computed it
            self.results[name], self.timings[name] = self.ahead.pop(name)
            self._log(f"[{name}] computed by the shared corpus pass ({self.timings[name]:.1f} s)")
            return self.results[name]
        path = self.state_dir / f"{name}{STEP_SUFFIX}"
        stored, why = (_MISSING, None) if self.force else _load_step(path)
        # every rank follows rank 0: loading skips the step's collectives, so ranks must agree
        if main_process_decides(stored is not _MISSING):
            if stored is _MISSING:  # rank 0 read the file but this rank cannot
                raise RuntimeError(
                    f"Rank 0 loaded {path} but this rank cannot read it; do all ranks share "
                    "the output folder? Rerun with --force to recompute."
                )
            self.results[name] = stored
            computed_in = self._stored_timings().get(name)
            if computed_in is not None:  # the time it took when it was computed
                self.timings[name] = computed_in
            self._log(f"[{name}] loaded from {path}")
            return stored
        if why is not None:
            self._log(f"[{name}] stored result not used ({why}); recomputing")
        elif not self.force and path.with_suffix(".pkl").exists():
            self._log(
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

    def _store(self, name: str, value: Any, seconds: float) -> None:
        """Write step `name`'s value and the seconds it took atomically (rank 0)."""
        if is_main_process():
            _store_step(self.state_dir / f"{name}{STEP_SUFFIX}", value)
            timings = {**self._stored_timings(), name: seconds}
            atomic_write_bytes(self.state_dir / TIMINGS_FILE, json.dumps(timings).encode())
        barrier()

    def is_stored(self, name: str) -> bool:
        """Whether step `name` has a stored result this run would load (not with `force`).

        Args:
            name: A step.

        Returns:
            True when its file is there.
        """
        return not self.force and (self.state_dir / f"{name}{STEP_SUFFIX}").exists()

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
        """Seconds each stored step took when it was computed (`{}` if none are recorded)."""
        try:
            return json.loads((self.state_dir / TIMINGS_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _log(self, message: str) -> None:
        if self.progress and is_main_process():
            print(message, file=sys.stderr, flush=True)


_MISSING = object()
# Per state folder: the seconds each step took when it was computed, so that a run that loads
# its steps reports how long they took to compute.
TIMINGS_FILE = "timings.json"


STEP_SUFFIX = ".safetensors"


def _load_step(path: Path) -> tuple[Any, str | None]:
    """The stored step result at `path` and `None`, or `_MISSING` and why it is not used
    (`None`: there is no file). A file that does not load is recomputed, never used."""
    from cw_lens.core.loading import read_file
    from cw_lens.core.saving import STEP_FORMAT

    if not path.exists():
        return _MISSING, None
    try:
        return read_file(path, file_format=STEP_FORMAT), None
    except (InputError, OSError) as exc:
        return _MISSING, str(exc)


def _store_step(path: Path, value: Any) -> None:
    """Write a step's value to `path` atomically (a temporary file in its folder, renamed)."""
    from cw_lens.core.saving import STEP_FORMAT, write_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_file(value, tmp, file_format=STEP_FORMAT)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


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
}


def causal_samples(job: Job) -> dict[str, list[int]]:
    """The corpus positions each causal part of the job runs on (`causal_indices`):
    `faithfulness` its `faithfulness_docs`, `pruning` its `pruning_docs`, and `lone_costs`
    (pruning's lone-head costs) `lone_docs` of pruning's documents.

    Args:
        job: The running job (its corpus loaded).

    Returns:
        `{part: sorted positions}` for every part of `CAUSAL_PARTS`.
    """
    cfg, n_corpus = job.config, len(job.corpus)
    pruning = causal_indices(n_corpus, cfg.pruning_docs, cfg.causal_seed)
    lone = min(cfg.lone_docs or len(pruning), len(pruning))  # nested: within pruning's
    return {
        "faithfulness": causal_indices(n_corpus, cfg.faithfulness_docs, cfg.causal_seed),
        "pruning": pruning,
        "lone_costs": causal_indices(n_corpus, lone, cfg.causal_seed),
    }


def causal_corpus(job: Job, part: str) -> Any:
    """The documents causal part `part` of the job runs on (`causal_samples`), as a corpus.

    Args:
        job: The running job (its corpus loaded).
        part: `"faithfulness"`, `"pruning"` or `"lone_costs"`.

    Returns:
        A [`Corpus`][cw_lens.Corpus] of those documents, in corpus order.
    """
    return job.corpus.subset(causal_samples(job)[part])


def claim_documents(job: Job, claims: Iterable[str]) -> dict[str, int]:
    """How many documents each claim's numbers come from: faithfulness its random sample of
    `faithfulness_docs`, pruning its sample of `pruning_docs` (`causal_samples`), every
    other claim the corpus."""
    n_docs = len(job.corpus)
    wanted = {
        "faithfulness_order": job.config.faithfulness_docs,
        "pruning_signal": job.config.pruning_docs,
    }
    return {cid: min(wanted.get(cid) or n_docs, n_docs) for cid in claims}
