"""The population: every window of the coverage pool, each document's records stored in shards.

``benchmarks/coverage.py`` draws its documents from a pool (the paper preset's 256 windows) and
takes the pool's value as the truth. This job computes the per-document records of the corpus
analyses (sink statistics, selection geometry, head taxonomy, sink ablation) for the *whole*
window pool of the embedded model, ``load_corpus("pydoc+stdlib", max_tokens=256)``'s 1,324
windows of this Python's pydoc + stdlib text, so that a coverage study can draw documents
*without* replacement from a population whose every value is known (``study`` below).

Shards. The pool's document batches (8 windows each, in corpus order: the batch plan of a
single run on the whole pool) are dealt round-robin to ``world`` shards of 4 batches each
(``world = ceil(batches / 4)`` = 42 for 1,324 windows): shard ``k`` holds batches ``k, k +
world, ...``, exactly as rank ``k`` of ``torchrun --nproc-per-node world`` would, so every
document is computed in the batch, and with the index, it has in a single run on the whole
pool, and the shards written so far are spread over the whole text. Each shard is one
``shard_<k>_of_<world>.npz`` (numpy, compressed, no pickle) under ``--out``, written
atomically; a rerun skips the shards already written, so the job resumes across sessions.
``manifest.json`` records what the records depend on (the model file's SHA-256, the cw_lens
and torch versions, the corpus windows' token hash, the analyses' settings, the shard plan):
a run whose manifest differs refuses to add shards to the folder.

What a shard stores, per document (float32 unless an array is whole numbers that fit a
smaller unsigned integer, stored as that: lossless):

- ``documents``: the pool indices of its documents;
- ``taxonomy.winners`` ``[doc, layer, head, 3]``: the head taxonomy's winner counts;
- ``sinks.sums`` ``[doc, 14, layer, head]`` and ``sinks.share_hist`` ``[doc, layer, head,
  26]``: the sink statistics' per-document record (``SinkStatisticsResult.record``, its
  ``record_names``: the 14 ``RECORDED_SUMS``, then the 26 coarse cancelled-share bins);
- ``sinks.samples.index`` ``[entry, 5]`` (document, layer, head, query, key) and
  ``sinks.samples.factors`` ``[entry, 4]``: the shard's sink-column factor samples
  (``samples_table``'s sink group) whose reservoir key (``cw_lens.core.accumulators.
  entry_keys(seed, layer, document, head, query, key)``, recomputed from what is stored: a
  function of the entry and its pool index only) lies below ``RESERVOIR_FRACTION * 2**63``
  (0.5's keys lie in ``[0, 2**63)``). A run on the whole pool keeps, per head, the 1,024
  entries with the smallest keys; those are all below the cut (about 2,000 of the pool's
  entries per head are), so the merged shards give that reservoir exactly
  (:func:`load_population` checks it). Shards of format 1 (cw_lens 0.3/0.4) selected their
  samples with 0.4's keys, which 0.5 does not compute: their sink statistics are refused
  (the other analyses still load);
- ``selection.f_and_count`` ``[doc, layer, rule, head, N, 2]``: F sums and scored queries;
- ``ablation.heads`` ``[doc, 5, layer, head]``, ``ablation.nll`` ``[doc, 4]``,
  ``ablation.planned`` ``[layer, head]``;
- ``meta``: a JSON string (shard, timings, the manifest's digest).

:func:`load_population` stacks the shards written so far into result objects of the library's
own classes, whose ``replicates(Bootstrap(documents=...))`` give every claim number on any
subset of the documents (what ``coverage.py``'s study reads).

    nice -n 19 python benchmarks/population.py run [--shards K ...] [--max-shards M]
    python benchmarks/population.py status
    python benchmarks/population.py study [--sizes 8 32 256] [--draws 400]
    python benchmarks/population.py compare-study [--draws 400]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

OUT = Path(__file__).parent / "records" / "population"  # committed: the shards are the data
CORPUS, MAX_TOKENS, WINDOW_SEED = "pydoc+stdlib", 256, 0
BATCH_SIZE = 8  # the main job's (and the paper preset's) batch size
BATCHES_PER_SHARD = 4  # 32 windows a shard
ANALYSIS_SEED = 0  # the paper preset's seed (sinks' factor sampling, selection's random rankings)
PAPER_DOCS = 256  # the paper preset's windows: load_corpus(n_docs=256, seed=0) of this pool
ANALYSES = ("taxonomy", "sinks", "selection", "ablation")
# a shard keeps the sink-column factor samples whose reservoir key (`entry_keys`, in
# [0, 2**63)) is below this share of 2**63: about 2x the share a whole-pool reservoir keeps
# (1,024 of ~339,000 entries per head)
RESERVOIR_FRACTION = 0.006
RESERVOIR_CUT = int(RESERVOIR_FRACTION * 2**63)
# the shard files' layout; bump when it changes. 2: cw_lens 0.5's record and entry_keys samples
# (format 1: 0.4's per-document tables and reservoir keys, whose sink samples 0.5 cannot read)
FORMAT = 2


# --------------------------------------------------------------------------- the plan


def n_windows(tokenizer: Any) -> int:
    """How many windows of ``MAX_TOKENS`` tokens the pool's text holds (the pool's size)."""
    from cw_lens.data.sources import PROSE

    read, _ = PROSE[CORPUS]
    return len(tokenizer(read(), add_special_tokens=False)["input_ids"]) // MAX_TOKENS


def shard_plan(n_docs: int, batch_size: int = BATCH_SIZE) -> int:
    """The number of shards (``world``): batches of ``batch_size`` documents, four a shard."""
    return math.ceil(math.ceil(n_docs / batch_size) / BATCHES_PER_SHARD)


def shard_documents(n_docs: int, shard: int, world: int, batch_size: int = BATCH_SIZE) -> list[int]:
    """The pool indices shard ``shard`` of ``world`` holds: batches ``shard, shard + world,
    ...`` of the equal-length windows in corpus order (what ``iter_batches`` plans)."""
    starts = range(shard * batch_size, n_docs, world * batch_size)
    return [d for s in starts for d in range(s, min(s + batch_size, n_docs))]


@contextlib.contextmanager
def one_shard(shard: int, world: int) -> Iterator[None]:
    """Run the corpus analyses as rank ``shard`` of ``world`` would under torchrun, in this
    process and without a process group: only that rank's document batches, with their
    indices in the whole corpus, and no merge with the other ranks."""
    value = (shard, world)
    with (
        mock.patch("cw_lens.data.streaming.current_shard", lambda: value),
        mock.patch("cw_lens.data.scoring.current_shard", lambda: value),
        # 0.5's pass sums its counts across ranks when sharded: this rank's own, here
        mock.patch("cw_lens.data.streaming.StreamStats.all_reduce", lambda self: None),
    ):
        yield


# --------------------------------------------------------------------------- the manifest


def manifest(model: Any, corpus: Any) -> dict[str, Any]:
    """What the records depend on; a folder's shards are refused by a run whose manifest
    differs (``timestamp`` aside)."""
    import random

    import cw_lens
    from cw_lens.reproduction.provenance import corpus_provenance, weights_provenance

    n = len(corpus)
    paper = sorted(random.Random(WINDOW_SEED).sample(range(n), PAPER_DOCS))
    return {
        "format": FORMAT,
        "cw_lens": cw_lens.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "weights": weights_provenance(None, model, "float32"),
        "corpus": corpus_provenance(corpus, model.tokenizer),
        "n_windows": n,
        "batch_size": BATCH_SIZE,
        "batches_per_shard": BATCHES_PER_SHARD,
        "world": shard_plan(n),
        "analyses": {
            "taxonomy": {"function": "head_taxonomy", "settings": {}},
            "sinks": {"function": "sink_statistics", "settings": {"seed": ANALYSIS_SEED}},
            "selection": {"function": "selection_geometry", "settings": {"seed": ANALYSIS_SEED}},
            "ablation": {"function": "sink_ablation", "settings": {}},
        },
        "reservoir_fraction": RESERVOIR_FRACTION,
        "paper_windows": paper,  # the paper preset's 256 windows, as pool indices
        "threads": torch.get_num_threads(),
        # the code that ran (not part of the digest: cw_lens's version stands for its results)
        "code": {
            "cw_lens_path": str(Path(cw_lens.__file__).parent),
            "commit": os.environ.get("CW_LENS_SOURCE_COMMIT"),
        },
    }


def manifest_digest(record: dict[str, Any]) -> str:
    """SHA-256 (16 digits) of the manifest without its thread count (which changes no result
    here: one float32 product order per batch shape) and the code's path and commit."""
    keep = {k: v for k, v in record.items() if k not in ("threads", "code")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def check_manifest(folder: Path, record: dict[str, Any]) -> None:
    """Write ``manifest.json`` in a new folder; refuse a folder whose manifest differs."""
    path = folder / "manifest.json"
    if not path.exists():
        atomic_write(path, (json.dumps(record, indent=1) + "\n").encode())
        return
    stored = json.loads(path.read_text())
    if manifest_digest(stored) != manifest_digest(record):
        differ = sorted(k for k in {*stored, *record} if stored.get(k) != record.get(k))
        raise SystemExit(
            f"{folder}: its shards were computed under another manifest (differs in "
            f"{differ}); use another --out or remove the folder."
        )


# --------------------------------------------------------------------------- storage


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def compact(array: np.ndarray) -> np.ndarray:
    """``array`` in the smallest unsigned integer type that holds it exactly when it is whole
    non-negative numbers below 2**16 (counts), else unchanged: lossless either way."""
    if array.dtype.kind != "f" or array.size == 0:
        return array
    if not np.isfinite(array).all() or (array < 0).any() or (array != np.round(array)).any():
        return array
    top = float(array.max())
    for kind in (np.uint8, np.uint16):
        if top <= np.iinfo(kind).max:
            return array.astype(kind)
    return array


def save_shard(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """One shard's records as a compressed ``.npz`` (integer counts stored as such), written
    atomically; ``meta`` as a JSON string inside it."""
    body = {k: compact(np.asarray(v)) for k, v in arrays.items()}
    body["meta"] = np.array(json.dumps(meta))
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **body)
    atomic_write(path, buffer.getvalue())


def load_shard(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A shard's arrays (records as float32, as the analyses keep them) and its meta."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files if k != "meta"}
        meta = json.loads(str(npz["meta"]))
    for key, value in arrays.items():
        if key not in ("documents", "sinks.samples.index", "ablation.planned"):
            arrays[key] = value.astype(np.float32)
    return arrays, meta


def shard_path(folder: Path, shard: int, world: int) -> Path:
    return folder / f"shard_{shard:03d}_of_{world:03d}.npz"


# --------------------------------------------------------------------------- one shard


def sample_keys(index: np.ndarray | torch.Tensor, seed: int = ANALYSIS_SEED) -> torch.Tensor:
    """The reservoir keys of sink-column factor samples, ``index`` ``[entry, 5]`` (document,
    layer, head, query, key; the document its pool index): the keys the sink statistics'
    reservoir ranked them by, ``entry_keys(seed, layer, document, head, query, key)``
    (``SinkStatisticsAccumulator._sample``)."""
    from cw_lens.core.accumulators import entry_keys

    index = torch.as_tensor(np.asarray(index), dtype=torch.int64).reshape(-1, 5)
    keys = torch.empty(len(index), dtype=torch.int64)
    for layer in index[:, 1].unique().tolist():
        mine = index[:, 1] == layer
        doc, _, head, query, key = index[mine].T
        keys[mine] = entry_keys(seed, int(layer), doc, head, query, key)
    return keys


def sink_samples(result: Any, docs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The sink column's factor samples of a shard's reservoir whose key is below the cut:
    ``index`` ``[entry, 5]`` (document, layer, head, query, key) and ``factors`` ``[entry,
    4]`` (``FACTOR_FIELDS``), from ``result.samples_table``'s sink group; checks that they
    are the shard's documents' and that the reservoir dropped none of them (a head whose
    reservoir is full holds only keys below the cut)."""
    from cw_lens.analyses.sinks.statistics_layout import (
        FACTOR_FIELDS,
        GROUPS,
        MAX_SAMPLES_PER_HEAD,
        SAMPLE_COLUMNS,
    )

    table = result.samples_table
    table = table[table[:, 0] == GROUPS.index("sink"), 1:]
    column = {c: i for i, c in enumerate(SAMPLE_COLUMNS)}
    coords = ("document", "layer", "head", "query", "key")
    index = table[:, [column[c] for c in coords]].double().long()  # whole numbers in float32
    factors = table[:, [column[c] for c in FACTOR_FIELDS]].float()
    if not set(index[:, 0].tolist()) <= set(docs):
        raise RuntimeError("the sink samples hold documents the shard did not run.")
    keys = sample_keys(index)
    heads = index[:, 1] * result.n_heads + index[:, 2]  # layer number x head: one id per head
    for head in heads.unique().tolist():
        mine = keys[heads == head]
        if len(mine) >= MAX_SAMPLES_PER_HEAD and int(mine.max()) < RESERVOIR_CUT:
            raise RuntimeError(
                f"the sink reservoir of head {divmod(head, result.n_heads)} (layer, head) is full "
                "below the cut: it may have dropped entries the population needs; lower "
                "RESERVOIR_FRACTION (a new --out)."
            )
    below = keys < RESERVOIR_CUT
    return index[below].numpy(), factors[below].numpy()


def run_analyses(model: Any, corpus: Any, analyses: Sequence[str] = ANALYSES) -> dict[str, Any]:
    """The analyses on ``corpus`` as the main job runs them (``per_document=True``), with the
    wall and CPU seconds of each."""
    from cw_lens.analyses.selection import selection_geometry
    from cw_lens.analyses.sinks import sink_ablation, sink_statistics
    from cw_lens.analyses.taxonomy import head_taxonomy

    functions = {
        "taxonomy": (head_taxonomy, {}),
        "sinks": (sink_statistics, {"seed": ANALYSIS_SEED}),
        "selection": (selection_geometry, {"seed": ANALYSIS_SEED}),
        "ablation": (sink_ablation, {}),
    }
    out: dict[str, Any] = {"seconds": {}}
    for name in analyses:
        fn, settings = functions[name]
        start, cpu = time.perf_counter(), time.process_time()
        out[name] = fn(
            model, corpus, batch_size=BATCH_SIZE, progress=False, per_document=True, **settings
        )
        out["seconds"][name] = [time.perf_counter() - start, time.process_time() - cpu]
    return out


def records(results: dict[str, Any], docs: Sequence[int]) -> dict[str, np.ndarray]:
    """The per-document arrays of a shard (or of a normal run: ``docs`` its documents)."""
    out: dict[str, np.ndarray] = {"documents": np.asarray(docs, np.int32)}
    if "taxonomy" in results:
        out["taxonomy.winners"] = results["taxonomy"].per_document.numpy()
    if "sinks" in results:
        stats = results["sinks"]
        out["sinks.sums"], out["sinks.share_hist"] = sink_record_parts(stats)
        out["sinks.samples.index"], out["sinks.samples.factors"] = sink_samples(stats, docs)
    if "selection" in results:
        out["selection.f_and_count"] = results["selection"].per_document.numpy()
    if "ablation" in results:
        heads, nll, planned = results["ablation"].per_document
        out.update({"ablation.heads": heads.numpy(), "ablation.nll": nll.numpy()})
        out["ablation.planned"] = planned.numpy()
    for key, value in out.items():
        if key not in ("documents", "ablation.planned") and not key.startswith("sinks.samples"):
            if value.shape[0] != len(docs):
                raise RuntimeError(f"{key}: {value.shape[0]} documents recorded, {len(docs)} run.")
    return out


def settings(results: dict[str, Any]) -> dict[str, Any]:
    """What the result objects need beside the records (:func:`load_population`), for the
    analyses in ``results``."""
    out: dict[str, Any] = {}
    if "selection" in results:
        sel = results["selection"]
        out["selection"] = {
            "n_grid": list(sel.n_grid),
            "query": sel.query,
            "n_random": sel.n_random,
            "sink_positions": list(sel.sink_positions),
            "distance": sel.distance,
        }
    if "ablation" in results:
        abl = results["ablation"]
        out["ablation"] = {
            "layers": list(abl.layers),
            "scale": abl.scale,
            "mode": abl.mode,
            "effect": abl.effect,
            "low_norm_quantile": abl.low_norm_quantile,
        }
    if "sinks" in results:
        sinks = results["sinks"]
        out["sinks"] = {
            "layers": list(sinks.layers),
            "min_query": sinks.min_query,
            "sinks": sinks.sinks,
            "threshold": sinks.threshold,
        }
    return out


def sink_sums() -> tuple[str, ...]:
    from cw_lens.analyses.sinks import RECORDED_SUMS

    return RECORDED_SUMS


def sink_record_names() -> list[str]:
    """The names of the sink statistics' per-document record this job stores, in order: the
    recorded sums (``sinks.sums``), then the cancelled-share bins (``sinks.share_hist``)."""
    from cw_lens.analyses.sinks.statistics_layout import SHARE_BIN_SUMS

    return [*sink_sums(), *SHARE_BIN_SUMS]


def sink_record_parts(stats: Any) -> tuple[np.ndarray, np.ndarray]:
    """A sink statistics result's per-document record (``record``, ``[doc, layer, head,
    recorded]``) as the shards store it: the sums ``[doc, 14, layer, head]`` and the coarse
    cancelled-share histograms ``[doc, layer, head, 26]``."""
    if stats.record is None:
        raise RuntimeError("the sink statistics were run without per_document=True.")
    if list(stats.record_names) != sink_record_names():
        raise RuntimeError("the sink statistics record other sums than this job stores.")
    record = stats.record.float().numpy()
    n_sums = len(sink_sums())
    return (
        np.ascontiguousarray(record[..., :n_sums].transpose(0, 3, 1, 2)),
        np.ascontiguousarray(record[..., n_sums:]),
    )


def run_shard(model: Any, corpus: Any, shard: int, world: int, folder: Path, digest: str) -> dict:
    """Compute and store one shard; returns its meta."""
    docs = shard_documents(len(corpus), shard, world)
    start = time.perf_counter()
    with one_shard(shard, world):
        results = run_analyses(model, corpus)
    # the record holds the documents some block recorded, in pool order
    if results["sinks"].record is None or results["sinks"].record.shape[0] != len(docs):
        raise RuntimeError(f"shard {shard}: the sink record holds other documents.")
    arrays = records(results, docs)
    meta = {
        "shard": shard,
        "world": world,
        "manifest": digest,
        "n_documents": len(docs),
        "n_tokens": int(results["sinks"].n_tokens),
        "seconds": results["seconds"],
        "settings": settings(results),
        "wall_s": time.perf_counter() - start,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    save_shard(shard_path(folder, shard, world), arrays, meta)
    return meta


def load_model_and_pool() -> tuple[Any, Any]:
    import cw_lens
    from cw_lens.data.corpora import resolve_tokenizer

    model = cw_lens.load_model()
    n = n_windows(resolve_tokenizer(model))
    corpus = cw_lens.load_corpus(CORPUS, n_docs=n, max_tokens=MAX_TOKENS, model=model, seed=0)
    return model, corpus


def run(folder: Path, shards: list[int] | None, max_shards: int | None) -> None:
    model, corpus = load_model_and_pool()
    record = manifest(model, corpus)
    folder.mkdir(parents=True, exist_ok=True)
    check_manifest(folder, record)
    digest, world = manifest_digest(record), record["world"]
    todo = [k for k in (shards if shards is not None else range(world))]
    todo = [k for k in todo if not shard_path(folder, k, world).exists()]
    if max_shards is not None:
        todo = todo[:max_shards]
    print(f"[population] {len(corpus)} windows, {world} shards, {len(todo)} to do", flush=True)
    for k in todo:
        with claimed(shard_path(folder, k, world)) as mine:
            if not mine:  # written or being written by another process since the plan
                continue
            meta = run_shard(model, corpus, k, world, folder, digest)
        size = shard_path(folder, k, world).stat().st_size
        print(
            f"[population] shard {k}/{world}: {meta['n_documents']} documents, "
            f"{meta['wall_s']:.0f} s wall, {size / 1e6:.2f} MB "
            + " ".join(f"{n}={s[0]:.0f}s" for n, s in meta["seconds"].items()),
            flush=True,
        )


@contextlib.contextmanager
def claimed(path: Path) -> Iterator[bool]:
    """Whether this process may compute the shard ``path``: not written yet, and no live
    process holds its claim (``<path>.claim``, created exclusively, holding the owner's
    PID; a dead owner's claim is taken over). Several ``run`` processes with different
    shard orders (``--shards``) then share the work without computing a shard twice."""
    claim = path.with_name(path.name + ".claim")
    for _ in range(2):
        if path.exists():
            yield False
            return
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            owner = claim.read_text().strip() if claim.exists() else ""
            if owner.isdigit() and _alive(int(owner)):
                yield False
                return
            claim.unlink(missing_ok=True)  # a dead owner's claim
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(str(os.getpid()))
        try:
            yield not path.exists()
        finally:
            claim.unlink(missing_ok=True)
        return
    yield False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- loading


def load_population(
    folder: Path = OUT, analyses: Sequence[str] = ANALYSES
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shards written so far as result objects of the library's classes, their documents
    in pool order (row ``i`` of every record is pool window ``info["documents"][i]``), and
    ``info``: the manifest, the documents, whether the sink reservoir is the whole pool's
    exactly (``reservoir_exact``: every head has at least a reservoir's worth of entries below
    the cut, which holds once every shard is in)."""
    stored = json.loads((folder / "manifest.json").read_text())
    if "sinks" in analyses:  # before reading any shard
        if int(stored.get("format", 1)) < 2:
            raise SystemExit(
                f"{folder}: its shards are of format {stored.get('format', 1)} (cw_lens "
                f"{stored.get('cw_lens')}): their sink samples were selected by 0.4's reservoir "
                "keys, which cw_lens 0.5 does not compute (0.5 ranks them by entry_keys), so the "
                "sink statistics' driver sample cannot be rebuilt from them. Compute the shards "
                "again with `population.py run --out NEW` under this version, or study the other "
                "analyses (--analyses taxonomy selection ablation)."
            )
    digest, world = manifest_digest(stored), stored["world"]
    parts, metas = [], []
    for k in range(world):
        path = shard_path(folder, k, world)
        if path.exists():
            arrays, meta = load_shard(path)
            if meta["manifest"] != digest:
                raise SystemExit(f"{path}: computed under another manifest ({meta['manifest']}).")
            parts.append(arrays)
            metas.append(meta)
    if not parts:
        raise SystemExit(f"{folder}: no shard written yet.")
    docs = np.concatenate([p["documents"] for p in parts]).astype(np.int64)
    order = np.argsort(docs, kind="stable")

    def stacked(key: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([p[key] for p in parts])[order].copy())

    results: dict[str, Any] = {}
    info = {"manifest": stored, "documents": docs[order].tolist(), "shards": len(parts)}
    info["n_tokens"] = sum(m["n_tokens"] for m in metas)
    setting = metas[0]["settings"]
    if any(m["settings"] != setting for m in metas):
        raise SystemExit(f"{folder}: the shards were run with different analysis settings.")
    first = {"taxonomy": "taxonomy.winners", "selection": "selection.f_and_count"}
    first |= {"ablation": "ablation.heads", "sinks": "sinks.sums"}
    missing = [a for a in analyses if any(first[a] not in p for p in parts)]
    missing += [a for a in analyses if a != "taxonomy" and a not in setting and a not in missing]
    if missing:
        raise SystemExit(f"{folder}: the shards hold no records of {missing}.")
    if "taxonomy" in analyses:
        results["taxonomy"] = _taxonomy(stacked("taxonomy.winners"))
    if "selection" in analyses:
        results["selection"] = _selection(stacked("selection.f_and_count"), setting["selection"])
    if "ablation" in analyses:
        planned = torch.from_numpy(parts[0]["ablation.planned"].astype(bool))
        results["ablation"] = _ablation(
            stacked("ablation.heads"), stacked("ablation.nll"), planned, setting["ablation"]
        )
    if "sinks" in analyses:
        position = np.full(int(docs.max()) + 1, -1, np.int64)
        position[docs[order]] = np.arange(len(docs))
        index = np.concatenate([p["sinks.samples.index"] for p in parts]).astype(np.int64)
        factors = np.concatenate([p["sinks.samples.factors"] for p in parts])
        results["sinks"], info["reservoir_exact"] = _sinks(
            stacked("sinks.sums"),
            stacked("sinks.share_hist"),
            index.reshape(-1, 5),
            factors.reshape(-1, 4),
            position,
            setting["sinks"],
            info["n_tokens"],
        )
    return results, info


def _taxonomy(winners: torch.Tensor) -> Any:
    import pandas as pd

    from cw_lens.analyses.taxonomy import HeadTaxonomyResult

    return HeadTaxonomyResult(pd.DataFrame(), (0,), len(winners), per_document=winners)


def _selection(record: torch.Tensor, setting: dict[str, Any]) -> Any:
    from cw_lens.analyses.selection.geometry import SelectionGeometryResult

    return SelectionGeometryResult(
        torch.zeros(0),
        list(range(record.shape[1])),
        setting["n_grid"],
        setting["query"],
        setting["n_random"],
        ANALYSIS_SEED,
        tuple(setting["sink_positions"]),
        setting["distance"],
        len(record),
        per_document=record,
    )


def _ablation(
    heads: torch.Tensor, nll: torch.Tensor, planned: torch.Tensor, setting: dict[str, Any]
) -> Any:
    import pandas as pd

    from cw_lens.analyses.sinks import SinkAblationResult

    return SinkAblationResult(
        math.nan,
        math.nan,
        pd.DataFrame(),
        setting["scale"],
        setting["mode"],
        setting["effect"],
        setting["layers"],
        (heads, nll, planned),
        setting["low_norm_quantile"],
    )


def _sinks(
    sums: torch.Tensor,
    share_hist: torch.Tensor,
    index: np.ndarray,
    factors: np.ndarray,
    position: np.ndarray,
    setting: dict[str, Any],
    n_tokens: int = 0,
) -> tuple[Any, bool]:
    """A :class:`SinkStatisticsResult` whose per-document record and sink-group factor sample
    are the population's: the record rows in pool order; the sample, per head, the
    ``MAX_SAMPLES_PER_HEAD`` stored entries with the smallest keys (``sample_keys``, from
    each entry's pool index), their documents re-indexed to rows of the record (``position``:
    row of each pool index, -1 where not loaded). Also whether that sample is the whole
    pool's (that of a run on the loaded documents) exactly: every head has a reservoir's worth
    of stored entries (all below the cut), or the cut keeps every entry."""
    from cw_lens.analyses.sinks.statistics_layout import MAX_SAMPLES_PER_HEAD
    from cw_lens.core.accumulators import EMPTY_KEY

    record = torch.cat([sums.permute(0, 2, 3, 1), share_hist], -1).float().contiguous()
    n_layers, n_heads = record.shape[1], record.shape[2]
    layers = [int(layer) for layer in setting["layers"]]
    if len(layers) != n_layers:
        raise SystemExit(f"the sink record holds {n_layers} layers, the settings {layers}.")
    keys = sample_keys(index).numpy()
    order = np.lexsort((keys, index[:, 2], index[:, 1]))  # by layer, head, then key
    index, factors, keys = index[order], np.asarray(factors)[order], keys[order]
    head_id = index[:, 1] * n_heads + index[:, 2]
    first = np.r_[True, head_id[1:] != head_id[:-1]] if len(head_id) else np.zeros(0, bool)
    starts = np.maximum.accumulate(np.where(first, np.arange(len(head_id)), 0))
    keep = np.arange(len(head_id)) - starts < MAX_SAMPLES_PER_HEAD  # each head's smallest keys
    rows = position[index[keep, 0]]
    if (rows < 0).any():
        raise SystemExit("the sink samples hold documents no loaded shard recorded.")
    counts = Counter(head_id[keep].tolist())
    every_head = [a * n_heads + h for a in layers for h in range(n_heads)]
    full = all(counts.get(head, 0) >= MAX_SAMPLES_PER_HEAD for head in every_head)
    exact = full or RESERVOIR_CUT >= EMPTY_KEY  # keys lie below EMPTY_KEY
    table = torch.cat(
        [
            torch.zeros(int(keep.sum()), 1),  # group 0: the sink entries
            torch.from_numpy(index[keep, 1:].astype(np.float32)),  # layer, head, query, key
            torch.from_numpy(factors[keep].astype(np.float32)),
            torch.from_numpy(rows.astype(np.float32))[:, None],  # the record row
        ],
        1,
    )
    return sink_result(record, table, setting, n_tokens), bool(exact)


def sink_result(
    record: torch.Tensor, samples_table: torch.Tensor, setting: dict[str, Any], n_tokens: int = 0
) -> Any:
    """A :class:`SinkStatisticsResult` holding what its replicates read
    (``cw_lens.reproduction.replicates``: the per-document ``record`` and the sink group's
    ``samples_table``, documents as record rows) and nothing it does not know: the corpus
    totals of the recorded sums are the record's, the other sums and the sink-rate curve are
    NaN and the histograms (s*, drift) empty, so its tables (``heads``, ``claims``) are not
    a run's; the population's numbers are its replicates."""
    from cw_lens.analyses.sinks import SinkStatisticsResult
    from cw_lens.analyses.sinks.detection import MIN_QUERY, SINK_RATE_THRESHOLD
    from cw_lens.analyses.sinks.statistics_layout import (
        DRIFT_SHARE_BINNING,
        RATE_BINS,
        SUM_NAMES,
    )
    from cw_lens.core.accumulators import Histogram

    n_layers, n_heads = record.shape[1], record.shape[2]
    names = sink_record_names()
    sums = torch.full((n_layers, n_heads, len(SUM_NAMES)), math.nan, dtype=torch.float64)
    totals = record.double().sum(0)
    for i, name in enumerate(names):
        sums[..., SUM_NAMES.index(name)] = totals[..., i]
    shape = (n_layers, n_heads)
    return SinkStatisticsResult(
        layers=[int(layer) for layer in setting["layers"]],
        n_heads=n_heads,
        sinks=str(setting.get("sinks", "0")),
        n_documents=int(record.shape[0]),
        n_tokens=int(n_tokens),
        sum_names=list(SUM_NAMES),
        sums=sums,
        curve_sums=torch.full((*shape, RATE_BINS, 2), math.nan, dtype=torch.float64),
        s_star=Histogram(shape, 0.0, 1.0, 50),
        drift_cos=Histogram(shape, -1.0, 1.0, 100),
        drift_share=Histogram(shape, **DRIFT_SHARE_BINNING),
        samples_table=samples_table,
        record_names=names,
        record=record,
        min_query=int(setting.get("min_query", MIN_QUERY)),
        threshold=float(setting.get("threshold", SINK_RATE_THRESHOLD)),
    )


# --------------------------------------------------------------------------- the coverage study

STUDY_OUT = Path(__file__).parent / "records" / "coverage_population.json"


def lower_bound(covered: int, draws: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson lower confidence bound of a binomial proportion
    (``covered`` of ``draws``): the ``1 - confidence`` quantile of Beta(covered, draws -
    covered + 1); 0 when nothing covered."""
    from scipy.stats import beta

    if covered <= 0:
        return 0.0
    return float(beta.ppf(1 - confidence, covered, draws - covered + 1))


def certified(coverage: float, lower: float) -> bool:
    """An interval certifies a document count when its coverage is at least 0.93 and the
    coverage's lower 95% bound at least 0.91 (docs/coverage.md#the-population; the library's
    rule, ``cw_lens.reproduction.interval_coverage.certifies``)."""
    from cw_lens.reproduction.interval_coverage import certifies

    return certifies(coverage, lower)


def within_target(any_differ: int, draws: int) -> bool:
    """Whether ``cw-lens compare``'s measured family-wise error meets its 0.05 target, by the
    certificate's own rule (``certified``, i.e.
    ``cw_lens.reproduction.interval_coverage.certifies``) read on the share of draws with no false
    ``differ`` (the simultaneous coverage Holm's adjustment promises at 0.95): that share at least
    0.93 and its one-sided Clopper-Pearson lower 95% bound at least 0.91. In error terms: a
    family-wise error of at most 0.07 and an upper 95% bound (``1 -`` that lower bound) of at most
    0.09, as a coverage certifies with at most 7% misses and a miss rate bounded by 9%
    (docs/reproducing.md)."""
    clean = draws - any_differ
    return certified(clean / draws, lower_bound(clean, draws))


def sub_pools(n_rows: int, parts: int = 4) -> list[list[int]]:
    """``parts`` disjoint sub-pools of consecutive record rows (pool order: consecutive
    windows of the text, so the quarters differ in what they read), as equal as possible."""
    edges = [round(i * n_rows / parts) for i in range(parts + 1)]
    return [list(range(edges[i], edges[i + 1])) for i in range(parts)]


def shipped_method(number: str) -> str:
    """The interval method the library ships for ``number``
    (``cw_lens.reproduction.bootstrap.needs_bias_correction``): the bias-corrected interval for a
    plug-in known to be biased (the geometric means), the expanded one otherwise."""
    from cw_lens.reproduction.bootstrap import Bootstrap, needs_bias_correction

    boot = Bootstrap()
    return boot.biased_method if needs_bias_correction(number) else boot.method


# --------------------------------------------------------------------------- designs


def adjacent_pairs(n_pool: int, n: int, gen: torch.Generator) -> list[int]:
    """A draw made of ``n // 2`` pairs of adjacent windows (window ``w`` and ``w + 1`` of the
    text; record rows are pool windows in order): the pool cut into consecutive pairs from a
    random phase (0 or 1), ``n // 2`` of them drawn without replacement, both windows of each
    taken. The most dependent draw of that size: per-window resampling treats each pair as
    two independent documents."""
    if n % 2:
        raise ValueError(f"a draw of adjacent pairs needs an even size, got {n}.")
    phase = int(torch.randint(2, (1,), generator=gen))
    starts = list(range(phase, n_pool - 1, 2))
    if n // 2 > len(starts):
        raise ValueError(f"{n // 2} adjacent pairs do not fit a pool of {n_pool}.")
    chosen = torch.randperm(len(starts), generator=gen)[: n // 2].tolist()
    return [w for i in chosen for w in (starts[i], starts[i] + 1)]


def adjacent_in(docs: Sequence[int]) -> int:
    """How many pairs of a draw's windows are neighbours in the text."""
    held = set(docs)
    return sum(1 for d in held if d + 1 in held)


DESIGNS = {"random": None, "adjacent": adjacent_pairs}


def with_bounds(rows: list[dict[str, Any]], pool: str) -> list[dict[str, Any]]:
    """Rows of ``coverage.py``'s study with the lower bound, the certification and the pool."""
    for row in rows:
        row["lower"] = lower_bound(int(row["covered"]), int(row["draws"]))
        row["certified"] = certified(float(row["coverage"]), row["lower"])
        row["pool"] = pool
    return rows


def certified_from(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per number: the smallest document count ``n`` from which the shipped method certifies
    on the whole population at ``n`` and at every larger studied count (None: not even at the
    largest; ``cw_lens.reproduction.interval_coverage.smallest_certified``)."""
    from cw_lens.reproduction.interval_coverage import smallest_certified

    counts: dict[str, dict[int, bool]] = {}
    for row in rows:
        if row["pool"] == "all" and row["method"] == shipped_method(row["number"]):
            counts.setdefault(row["number"], {})[int(row["n"])] = bool(row["certified"])
    return {number: smallest_certified(by_count) for number, by_count in counts.items()}


def coverage_study(
    results: dict[str, Any],
    sizes: Sequence[int],
    draws: int,
    resamples: int,
    *,
    drivers: bool = True,
    numbers: list[str] | None = None,
    parts: int = 4,
    part_draws: int | None = None,
    part_sizes: Sequence[int] | None = None,
    design: str = "random",
    seed_offset: int = 0,
) -> list[dict[str, Any]]:
    """The certification study (docs/coverage.md#the-population): ``draws`` draws of each count
    *without* replacement from the population (the truth: the population's value), then the same in
    each of ``parts`` disjoint sub-pools (the truth: the sub-pool's value; ``part_draws`` draws,
    default ``draws``; ``part_sizes``, default ``sizes``) for the spread from pool to pool.
    ``design``: ``random`` (a run's own design: distinct windows at random) or ``adjacent`` (pairs
    of neighbouring windows, ``adjacent_pairs``). ``seed_offset``: added to the whole
    population's draw and bootstrap seeds (0: the first study; ``SECOND_SEED``: the second).
    Rows as ``coverage.py``'s with ``lower`` (one-sided Clopper-Pearson 95%), ``certified``,
    ``pool`` and ``design``."""
    cov = _load_benchmark("coverage")
    draw = DESIGNS[design]
    rows = with_bounds(
        cov.study(
            results,
            list(sizes),
            draws,
            resamples,
            drivers,
            numbers,
            replace=False,
            subset=subset,
            draw=draw,
            seed_offset=seed_offset,
            boot_seed_offset=seed_offset,
        ),
        "all",
    )
    n_rows = cov.n_records(next(iter(results.values())))
    for q, members in enumerate(sub_pools(n_rows, parts) if parts > 1 else []):
        fits = [n for n in (part_sizes or sizes) if n <= len(members)]
        part = cov.study(
            results,
            fits,
            part_draws or draws,
            resamples,
            drivers,
            numbers,
            replace=False,
            pool=members,
            seed_offset=1_000_000 * (q + 1),
            subset=subset,
            draw=draw,
        )
        rows += with_bounds(part, f"part {q + 1} of {parts}")
    for row in rows:
        row["design"] = design
    return rows


def optimism_study(
    results: dict[str, Any],
    pool_size: int,
    n: int,
    pools: int,
    draws: int,
    resamples: int,
    numbers: list[str] | None = None,
) -> list[dict[str, Any]]:
    """How optimistic the single-pool double bootstrap (``coverage.py`` without a
    population: ``n`` documents drawn *with* replacement from one pool of ``pool_size``
    windows, the pool's value taken as the truth) is, on numbers whose population coverage
    is known: ``pools`` pools drawn without replacement from the population, ``draws``
    draws each. Rows per (number, pool): the pool's estimate of the shipped interval's
    coverage. Compare their mean and spread with the population study's coverage at ``n``."""
    cov = _load_benchmark("coverage")
    n_rows = cov.n_records(next(iter(results.values())))
    rows = []
    for p in range(pools):
        gen = torch.Generator().manual_seed(9_000_000 + 1_000 * pool_size + p)
        members = sorted(torch.randperm(n_rows, generator=gen)[:pool_size].tolist())
        part = cov.study(
            results,
            [n],
            draws,
            resamples,
            False,
            numbers,
            replace=True,
            pool=members,
            seed_offset=3_000_000 + 100_000 * p,
        )
        for row in part:
            if row["method"] == shipped_method(row["number"]):
                rows.append({**row, "pool": p, "pool_size": pool_size})
    return rows


def study_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per (number, n), the shipped method's coverage [lower bound] on the whole
    population, certified or not, and its range over the sub-pools."""
    lines = [
        "| analysis | number | n | draws | coverage [lower 95%] | certified | sub-pools "
        "(min–max) | mean bias/SE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    shipped = [r for r in rows if r["method"] == shipped_method(r["number"])]
    for row in (r for r in shipped if r["pool"] == "all"):
        parts = [
            r["coverage"]
            for r in shipped
            if r["pool"] != "all" and (r["number"], r["n"]) == (row["number"], row["n"])
        ]
        spread = f"{min(parts):.3f}–{max(parts):.3f}" if parts else "—"
        lines.append(
            f"| {row['analysis']} | `{row['number']}` | {row['n']} | {row['draws']} | "
            f"{row['coverage']:.3f} [{row['lower']:.3f}] | {'yes' if row['certified'] else 'no'}"
            f" | {spread} | {row['mean_bias_to_se']:.2f} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- second studies

SECOND_SEED = 50_000_000  # the second study's seed offset: its draws share no seed with the first
SECOND_OUT = STUDY_OUT.with_name("coverage_population_second.json")
TARGET = 0.93  # the certificate's coverage threshold (``interval_coverage.certifies``)


def near_target(row: dict[str, Any]) -> bool:
    """Whether a study row's coverage lies within 2 binomial standard errors (at the target,
    with the row's draws) of 0.93: close enough that one study's luck decides its certificate,
    so a second, independent study is run and the certificate read on the pooled draws."""
    return abs(float(row["coverage"]) - TARGET) <= 2 * math.sqrt(
        TARGET * (1 - TARGET) / int(row["draws"])
    )


def second_study_plan(study: dict[str, Any]) -> dict[str, dict[str, list]]:
    """Per analysis, the (number, size) pairs (``rows``) of the first study's shipped-method
    rows on the whole population that are ``near_target``, and the numbers and sizes a study
    must run to measure them (it measures only those pairs' rows)."""
    plan: dict[str, dict[str, list]] = {}
    for row in study["rows"]:
        if row["pool"] == "all" and row["method"] == shipped_method(row["number"]):
            if near_target(row):
                entry = plan.setdefault(row["analysis"], {"numbers": [], "sizes": [], "rows": []})
                for key, value in (("numbers", row["number"]), ("sizes", int(row["n"]))):
                    if value not in entry[key]:
                        entry[key].append(value)
                entry["rows"].append([row["number"], int(row["n"])])
    return plan


def pooled(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """A row of two independent studies of the same (number, n, method): coverage, standard
    error, lower bound and certificate on their pooled draws, each study's own counts kept."""
    covered = int(first["covered"]) + int(second["covered"])
    draws = int(first["draws"]) + int(second["draws"])
    share = covered / draws
    lower = lower_bound(covered, draws)
    studies = [
        {k: s[k] for k in ("covered", "draws", "coverage", "lower", "missing")}
        for s in (first, second)
    ]
    return {
        **first,
        "coverage": share,
        "covered": covered,
        "draws": draws,
        "missing": int(first["missing"]) + int(second["missing"]),
        "se": _load_benchmark("coverage").binomial_se(covered, draws),
        "lower": lower,
        "certified": certified(share, lower),
        "studies": studies,
    }


def with_second(rows: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first study's rows, each one ``near_target`` that a second study repeated replaced by
    the pooled row (a second study may measure more rows than those: they are not pooled)."""
    key = ("analysis", "number", "n", "method", "pool")
    again = {tuple(r[k] for k in key): r for r in second}
    if len(again) < len(second):  # parts of one study: merge them first (merge-draws)
        counts = Counter(tuple(r[k] for k in key) for r in second)
        twice = next(k for k, count in counts.items() if count > 1)
        raise SystemExit(
            f"second studies: {twice} is in more than one row; merge the parts of one study "
            "with `population.py merge-draws` first."
        )
    return [
        pooled(r, again[k]) if (k := tuple(r[f] for f in key)) in again and near_target(r) else r
        for r in rows
    ]


def merge_studies(studies: list[dict[str, Any]]) -> dict[str, Any]:
    """One study from several run on the same population with the same settings (one process
    per analysis): their rows, and ``certified_from`` over all of them; the metas must agree
    except in wall time."""

    def settings(meta: dict[str, Any]) -> dict[str, Any]:  # reservoir_exact: with sinks only
        return {k: v for k, v in meta.items() if k not in ("wall_s", "reservoir_exact", "plan")}

    first = settings(studies[0]["meta"])
    if any(settings(s["meta"]) != first for s in studies[1:]):
        raise SystemExit("merge: the studies were run with different settings or populations.")
    rows = [row for s in studies for row in s["rows"]]
    meta = {**first, "wall_s": [s["meta"].get("wall_s") for s in studies]}
    exact = [s["meta"]["reservoir_exact"] for s in studies if s["meta"].get("reservoir_exact")]
    meta["reservoir_exact"] = exact[0] if exact else None
    if any("plan" in s["meta"] for s in studies):  # second studies: read only pooled with the first
        meta["plan"] = {a: e for s in studies for a, e in s["meta"].get("plan", {}).items()}
        return {"meta": meta, "rows": rows}
    return {"meta": meta, "rows": rows, "certified_from": certified_from(rows)}


def merge_draw_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``coverage.py`` study from parts of it run in turn (``--seed-offset`` base, base +
    draws of the first part, ...): a part's draw ``d`` is draw ``offset - base + d`` of the
    whole, so rows of the same (analysis, number, n, method) sum their covered, missing and
    draws. Refused unless every row's parts cover consecutive, disjoint draw ranges from the
    smallest offset and the parts share pool, resamples and source."""
    settings = [{k: p["meta"].get(k) for k in ("pool", "resamples", "source")} for p in parts]
    if any(s != settings[0] for s in settings[1:]):
        raise SystemExit(f"merge-draws: the parts were run with different settings: {settings}")
    base = min(int(p["meta"]["seed_offset"]) for p in parts)
    key = ("analysis", "number", "n", "method")
    grouped: dict[tuple, list[tuple[int, dict[str, Any]]]] = {}
    for part in parts:
        start = int(part["meta"]["seed_offset"]) - base
        for r in part["rows"]:
            grouped.setdefault(tuple(r[k] for k in key), []).append((start, r))
    rows = []
    for k, pieces in grouped.items():
        pieces.sort(key=lambda piece: piece[0])
        reached = 0
        for start, r in pieces:
            if start != reached:
                raise SystemExit(
                    f"merge-draws: {k}: a part starts at draw {start}, the parts before end at "
                    f"{reached}; run the parts with --seed-offset {base} + the draws before."
                )
            reached += int(r["draws"])
        truths = {float(r["truth"]) for _, r in pieces}
        if len(truths) > 1:
            raise SystemExit(f"merge-draws: {k}: the parts measured different truths {truths}.")
        covered = sum(int(r["covered"]) for _, r in pieces)
        share = covered / reached
        biased = [(float(r["mean_bias_to_se"]), int(r["draws"])) for _, r in pieces]
        biased = [(b, d) for b, d in biased if not math.isnan(b)]
        rows.append(
            {
                **pieces[0][1],
                "coverage": share,
                "covered": covered,
                "draws": reached,
                "missing": sum(int(r["missing"]) for _, r in pieces),
                "se": _load_benchmark("coverage").binomial_se(covered, reached),
                # each part's value is a mean over its draws (NaN ones left out): weighted by
                # its draws, an approximation where a part has NaN draws
                "mean_bias_to_se": sum(b * d for b, d in biased) / sum(d for _, d in biased)
                if biased
                else math.nan,
                "seconds": sum(float(r["seconds"]) for _, r in pieces),
                "cpu_seconds": sum(float(r["cpu_seconds"]) for _, r in pieces),
            }
        )
    meta = {
        **settings[0],
        "seed_offset": base,
        "parts": [
            {k: p["meta"].get(k) for k in ("seed_offset", "draws", "wall_s", "cpu_s")}
            for p in parts
        ],
    }
    return {"meta": meta, "rows": rows}


PACKAGE_TABLE = Path(__file__).parents[1] / "cw_lens" / "reproduction" / "interval_coverage.json"


def package_table(
    study: dict[str, Any],
    current: dict[str, Any],
    single_pool: list[dict[str, Any]] | None = None,
    second: list[dict[str, Any]] | None = None,
    second_single_pool: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The table the reports read (``cw_lens/reproduction/interval_coverage.json``): the
    population study's rows of the shipped method (whole population, ``source``
    ``"population"``) and, for the numbers it does not measure (the causal analyses,
    ``median_abs_rho_*``), single-pool rows (``"single_pool"``): those of ``single_pool``
    (``coverage.py``'s study, its shipped method) where it has the number, else the ones
    already in the table; each with its lower 95% bound and certificate. A row that a second,
    independent study repeated (``second``: the population's, ``second_single_pool``: a
    single pool's) is read on the two studies' pooled draws, each study's counts kept under
    ``studies``."""
    keep = ("analysis", "number", "n", "coverage", "covered", "se", "missing", "draws", "method")
    first = [
        r
        for r in study["rows"]
        if r["pool"] == "all" and r["method"] == shipped_method(r["number"])
    ]
    rows = [
        {**{k: r[k] for k in keep}, "lower": r["lower"], "source": "population"}
        | ({"studies": r["studies"]} if "studies" in r else {})
        for r in with_second(first, second or [])
    ]
    done = {r["number"] for r in rows}
    fresh = [r for r in single_pool or [] if r["method"] == shipped_method(r["number"])]
    fresh = [r for r in fresh if r["number"] not in done]
    renewed = {r["number"] for r in fresh}
    old = [r for r in current["rows"] if r["number"] not in done | renewed]
    singles = []
    for r in fresh + old:
        if "studies" in r:  # pooled already: its first study's own counts
            r = {**r, **r["studies"][0]}
        covered = int(r.get("covered", round(float(r["coverage"]) * int(r["draws"]))))
        singles.append(
            {
                **{k: r[k] for k in keep if k != "covered"},
                "covered": covered,
                "lower": lower_bound(covered, int(r["draws"])),
                "source": "single_pool",
                "pool": "single",
            }
        )
    again = []
    for r in second_single_pool or []:  # coverage.py's rows: no bound, no pool
        if r["method"] == shipped_method(r["number"]):
            covered = int(r.get("covered", round(float(r["coverage"]) * int(r["draws"]))))
            lower = lower_bound(covered, int(r["draws"]))
            again.append({**r, "covered": covered, "lower": lower, "pool": "single"})
    for r in with_second(singles, again):
        r.pop("pool")
        rows.append(r)
    for r in rows:
        r["certified"] = certified(float(r["coverage"]), r["lower"])
    sources = {
        "population": f"{study['meta']['documents']} windows, drawn without replacement",
        "single_pool": "the paper preset's windows, drawn with replacement (optimistic)",
    }
    head = {k: current[k] for k in ("method", "biased_method", "resamples")}
    return {**head, "source": "population and single_pool", "sources": sources, "rows": rows}


# --------------------------------------------------------------------------- the compare study


def draw_halves(
    n_rows: int, n_a: int, n_b: int, gen: torch.Generator
) -> tuple[list[int], list[int]]:
    """Two runs' documents from disjoint halves of the population: a random half of its
    rows for run a, the other half for run b, ``n_a`` and ``n_b`` drawn without replacement
    within each."""
    order = torch.randperm(n_rows, generator=gen).tolist()
    half = n_rows // 2
    first, second = order[:half], order[half:]
    if n_a > len(first) or n_b > len(second):
        raise ValueError(f"runs of {n_a} and {n_b} documents need halves of {max(n_a, n_b)}.")
    return first[:n_a], second[:n_b]


def write_run(
    folder: Path,
    results: dict[str, Any],
    docs: list[int],
    resamples: int,
    seed: int,
    drivers: bool,
) -> None:
    """A schema-3 run (``summary.json`` and ``replicates.npz``) of the population's documents
    ``docs``: one claim per analysis, one check per number (criterion ``> 0``: compare reads
    numbers, not verdicts), each with the shipped interval and its replicates."""
    import hashlib

    from cw_lens.reproduction.bootstrap import Bootstrap
    from cw_lens.reproduction.interval_coverage import STUDIED_MODEL
    from cw_lens.reproduction.resampled import is_biased_plugin
    from cw_lens.reproduction.run_replicates import FILE, pack
    from cw_lens.reproduction.verdicts import Check, Claim, claims_dict

    cov = _load_benchmark("coverage")
    boot = Bootstrap(resamples=resamples, seed=seed)  # on the subset: as documents=docs
    claims = []
    for name, result in results.items():
        checks = []
        for number, reps in cov.replicate_numbers(subset(result, docs), boot, drivers).items():
            low, high = boot.pair(reps, biased=is_biased_plugin(number))
            value = float(reps[resamples])
            checks.append(
                Check(number, value, ">", 0.0, interval=(low, high), replicates=reps[:resamples])
            )
        claims.append(Claim(name, "population", "compare study", checks))
    table = claims_dict(claims)
    hashes = [f"{d:016d}" for d in docs]
    npz = pack(table.replicates, hashes, {c.id: len(docs) for c in claims}, boot.to_dict())
    # the population is the coverage study's pool (the embedded model on pydoc+stdlib windows),
    # so compare applies the study's certificates to these runs as to the gallery's
    summary = {
        "schema": 3,
        "model": STUDIED_MODEL,
        "corpus": CORPUS,
        "max_tokens": MAX_TOKENS,
        "n_documents": len(docs),
        "claims": dict(table),
        "replicates": {"file": FILE, "sha256": hashlib.sha256(npz).hexdigest()},
    }
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary).replace("NaN", "null"))
    (folder / FILE).write_bytes(npz)


def compare_study(
    results: dict[str, Any],
    pairs: Sequence[tuple[int, int]],
    draws: int,
    resamples: int,
    *,
    drivers: bool = False,
    on_row: Any = None,
) -> list[dict[str, Any]]:
    """docs/coverage.md#the-population: ``cw-lens compare`` on two runs of disjoint halves of the
    population (no number truly differs, both halves being the population's), ``draws`` times per
    pair of document counts: the family-wise error is the share of draws with any ``differ``, with
    its one-sided Clopper-Pearson upper 95% bound; also how many numbers were not comparable (biased
    numbers across counts) per draw, and whether the error meets its target by the certificate's
    rule (``within_target``). ``on_row(rows)`` is called after each pair (e.g. to store the rows
    so far)."""
    import tempfile

    from scipy.stats import beta

    from cw_lens.reproduction.run_comparison import compare_runs
    from cw_lens.reproduction.run_replicates import DIFFER, NOT_COMPARABLE

    cov = _load_benchmark("coverage")
    n_rows = cov.n_records(next(iter(results.values())))
    rows = []
    for n_a, n_b in pairs:
        start = time.perf_counter()
        any_differ, flagged, refused = 0, {}, 0
        for d in range(draws):
            gen = torch.Generator().manual_seed(7_000_000 + 10_000 * n_a + 100 * n_b + d)
            docs_a, docs_b = draw_halves(n_rows, n_a, n_b, gen)
            with tempfile.TemporaryDirectory() as tmp:
                write_run(Path(tmp) / "a", results, docs_a, resamples, 2 * d, drivers)
                write_run(Path(tmp) / "b", results, docs_b, resamples, 2 * d + 1, drivers)
                table = compare_runs([Path(tmp) / "a", Path(tmp) / "b"]).differences()
            hits = table[table["result"] == DIFFER]
            any_differ += int(len(hits) > 0)
            for number in hits["number"]:
                flagged[number] = flagged.get(number, 0) + 1
            refused += int((table["result"] == NOT_COMPARABLE).sum())
        fwer = any_differ / draws
        upper = (
            1.0
            if any_differ == draws
            else float(beta.ppf(0.95, any_differ + 1, draws - any_differ))
        )
        rows.append(
            {
                "n_a": n_a,
                "n_b": n_b,
                "draws": draws,
                "family_wise_error": fwer,
                "upper_95": upper,
                "mc_se": math.sqrt(0.05 * 0.95 / draws),
                "within_target": within_target(any_differ, draws),
                "flagged": flagged,
                "not_comparable_per_draw": refused / draws,
                "numbers": len(table),
                "seconds": time.perf_counter() - start,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


# --------------------------------------------------------------------------- subsets


def subset(result: Any, docs: Sequence[int]) -> Any:
    """``result`` restricted to the record rows ``docs`` (distinct, in this order): the same
    numbers from ``replicates(Bootstrap(resamples, seed))`` as the whole result gives from
    ``replicates(Bootstrap(resamples, seed, documents=docs))``, at a cost that grows with
    ``len(docs)`` instead of the population's size (the bootstrap's weights cover every row
    of the record it is given)."""
    import copy

    if len(set(docs)) != len(docs):
        raise ValueError("subset takes distinct documents (draws without replacement).")
    idx = torch.as_tensor(list(docs), dtype=torch.long)
    if type(result).__name__ == "SinkStatisticsResult":
        return _sink_subset(result, list(docs), idx)
    out = copy.copy(result)
    record = result.per_document
    if isinstance(record, tuple):  # sink ablation: (per-head sums, NLL sums, patched heads)
        out.per_document = (record[0][idx], record[1][idx], record[2])
    else:
        out.per_document = record[idx]
    if hasattr(out, "n_documents"):
        out.n_documents = len(docs)
    return out


def _sink_subset(result: Any, docs: list[int], idx: torch.Tensor) -> Any:
    """The sink statistics of the rows ``docs``: their per-document record rows, and the
    factor samples of those documents only (both groups; each sample carries its document,
    the last column of ``samples_table``, re-indexed to the new rows), as ``sink_result``
    builds a result from them (the corpus totals the record does not hold are not known)."""
    from cw_lens.analyses.sinks.statistics_layout import SAMPLE_COLUMNS

    if result.record is None:
        raise SystemExit("subset: the sink statistics were run without per_document=True.")
    if list(result.record_names) != sink_record_names():
        raise SystemExit(f"subset: the sink record holds {result.record_names}, not this job's.")
    record = result.record
    position = torch.full((record.shape[0],), -1, dtype=torch.long)
    position[idx] = torch.arange(len(docs))
    table = result.samples_table
    column = 1 + SAMPLE_COLUMNS.index("document")  # after the group
    owner = table[:, column].double().long()
    if len(owner) and (owner.min() < 0 or owner.max() >= record.shape[0]):
        raise SystemExit("subset: the sink samples' documents are not rows of the record.")
    mine = position[owner] >= 0
    samples = table[mine].clone()
    samples[:, column] = position[owner[mine]].to(samples.dtype)
    setting = {
        "layers": list(result.layers),
        "sinks": result.sinks,
        "min_query": result.min_query,
        "threshold": result.threshold,
    }
    return sink_result(record[idx].clone(), samples, setting)


# --------------------------------------------------------------------------- CLI


def status(folder: Path) -> None:
    stored = json.loads((folder / "manifest.json").read_text())
    world = stored["world"]
    done = [k for k in range(world) if shard_path(folder, k, world).exists()]
    size = sum(shard_path(folder, k, world).stat().st_size for k in done)
    walls = [load_shard(shard_path(folder, k, world))[1]["wall_s"] for k in done]
    docs = sum(len(shard_documents(stored["n_windows"], k, world)) for k in done)
    print(
        json.dumps(
            {
                "shards_done": len(done),
                "shards": world,
                "documents_done": docs,
                "documents": stored["n_windows"],
                "mb": round(size / 1e6, 2),
                "mean_wall_s_per_shard": round(float(np.mean(walls)), 1) if walls else None,
            }
        )
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="compute the shards not written yet")
    p_run.add_argument("--out", type=Path, default=OUT)
    p_run.add_argument("--shards", type=int, nargs="+", help="only these shard indices")
    p_run.add_argument("--max-shards", type=int, help="stop after this many shards")
    p_run.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    p_status = sub.add_parser("status", help="shards done, size, seconds per shard")
    p_status.add_argument("--out", type=Path, default=OUT)
    p_study = sub.add_parser(
        "study", help="coverage drawn without replacement (docs/coverage.md#the-population)"
    )
    p_compare = sub.add_parser(
        "compare-study", help="compare's family-wise error (docs/coverage.md#the-population)"
    )
    p_optimism = sub.add_parser(
        "optimism", help="the single-pool double bootstrap's coverage on pools of the population"
    )
    p_merge = sub.add_parser(
        "merge", help="one study file from several (e.g. one process per analysis)"
    )
    p_merge.add_argument("parts", type=Path, nargs="+")
    p_draws = sub.add_parser(
        "merge-draws",
        help="one coverage.py study from parts run in turn with consecutive --seed-offset",
    )
    p_draws.add_argument("parts", type=Path, nargs="+")
    p_draws.add_argument("--result", type=Path, required=True)
    p_table = sub.add_parser(
        "package-table",
        help=f"write {PACKAGE_TABLE.name} from {STUDY_OUT.name} and the single-pool rows",
    )
    p_table.add_argument(
        "--second",
        type=Path,
        help=f"the population's second study ({SECOND_OUT.name}): its rows are pooled",
    )
    p_table.add_argument(
        "--second-single-pool",
        type=Path,
        nargs="+",
        help="coverage.py's second single-pool studies (--seed-offset; one file per study of "
        "other numbers): their rows are pooled",
    )
    p_table.add_argument(
        "--single-pool",
        type=Path,
        nargs="+",
        help="coverage.py's results (benchmarks/results/coverage.json; one file per study of "
        "other numbers): their rows replace the table's single-pool rows of the numbers they "
        "measure",
    )
    p_merge.add_argument("--result", type=Path, required=True)
    for p in (p_study, p_compare, p_optimism):
        p.add_argument("--out", type=Path, default=OUT)
        p.add_argument("--draws", type=int, default=400)
        p.add_argument("--resamples", type=int, default=2000)
        p.add_argument("--analyses", nargs="+", default=list(ANALYSES), choices=ANALYSES)
        p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    p_study.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 256])
    p_study.add_argument("--parts", type=int, default=4, help="disjoint sub-pools for the spread")
    p_study.add_argument("--part-draws", type=int, help="draws per sub-pool (default --draws)")
    p_study.add_argument("--part-sizes", type=int, nargs="+", help="sizes in the sub-pools")
    p_study.add_argument("--design", choices=sorted(DESIGNS), default="random")
    p_study.add_argument("--numbers", nargs="+", help="only these claim numbers")
    p_study.add_argument(
        "--without-drivers", action="store_true", help="leave out median_abs_rho_* (slow)"
    )
    p_study.add_argument("--result", type=Path, help=f"default {STUDY_OUT.name} (random design)")
    p_study.add_argument(
        "--second",
        action="store_true",
        help=f"the second, independent study (seeds offset by {SECOND_SEED:,}, whole population "
        f"only) of every row of {STUDY_OUT.name} within 2 binomial SEs of {TARGET} (default "
        f"result {SECOND_OUT.name}); --sizes and --numbers come from that plan",
    )
    p_optimism.add_argument("--pool-size", type=int, default=32)
    p_optimism.add_argument("--n", type=int, default=32)
    p_optimism.add_argument("--pools", type=int, default=20)
    p_optimism.add_argument("--numbers", nargs="+", help="only these claim numbers")
    p_optimism.add_argument("--result", type=Path)
    p_compare.add_argument(
        "--pairs", nargs="+", default=["8,8", "32,32", "256,256", "8,32", "32,256"]
    )
    p_compare.add_argument("--drivers", action="store_true", help="include median_abs_rho_*")
    p_compare.add_argument(
        "--result", type=Path, default=STUDY_OUT.with_name("compare_population.json")
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        torch.set_num_threads(args.threads)
        run(args.out, args.shards, args.max_shards)
    elif args.command == "merge":
        merged = merge_studies([json.loads(path.read_text()) for path in args.parts])
        atomic_write(args.result, (json.dumps(merged, indent=1) + "\n").encode())
        print(study_table(merged["rows"]))
    elif args.command == "merge-draws":
        merged = merge_draw_parts([json.loads(path.read_text()) for path in args.parts])
        atomic_write(args.result, (json.dumps(merged, indent=1) + "\n").encode())
    elif args.command == "package-table":
        single = (
            [r for path in args.single_pool for r in json.loads(path.read_text())["rows"]]
            if args.single_pool
            else None
        )
        body = package_table(
            json.loads(STUDY_OUT.read_text()),
            json.loads(PACKAGE_TABLE.read_text()),
            single,
            json.loads(args.second.read_text())["rows"] if args.second else None,
            [r for path in args.second_single_pool for r in json.loads(path.read_text())["rows"]]
            if args.second_single_pool
            else None,
        )
        atomic_write(PACKAGE_TABLE, (json.dumps(body, indent=1) + "\n").encode())
    elif args.command == "status":
        status(args.out)
    else:
        torch.set_num_threads(args.threads)
        results, info = load_population(args.out, tuple(args.analyses))
        meta = {
            "documents": len(info["documents"]),
            "windows": info["manifest"]["n_windows"],
            "shards": info["shards"],
            "reservoir_exact": info.get("reservoir_exact"),
            "draws": args.draws,
            "resamples": args.resamples,
            "manifest": manifest_digest(info["manifest"]),
        }
        start = time.perf_counter()
        if args.command == "study" and args.second:
            plan = second_study_plan(json.loads(STUDY_OUT.read_text()))
            plan = {a: v for a, v in plan.items() if a in args.analyses}
            meta.update(design=args.design, seed_offset=SECOND_SEED, plan=plan)
            args.result = args.result or SECOND_OUT
            rows = []
            for analysis, entry in plan.items():
                print(f"[second study] {analysis}: {entry}", flush=True)
                wanted = {tuple(pair) for pair in entry["rows"]}
                rows += [
                    row
                    for row in coverage_study(
                        {analysis: results[analysis]},
                        entry["sizes"],
                        args.draws,
                        args.resamples,
                        drivers=not args.without_drivers,
                        numbers=entry["numbers"],
                        parts=1,
                        design=args.design,
                        seed_offset=SECOND_SEED,
                    )
                    if (row["number"], int(row["n"])) in wanted
                ]
            body = {"meta": meta, "rows": rows}
            print(study_table(rows))
        elif args.command == "study":
            meta["design"] = args.design
            args.result = args.result or (
                STUDY_OUT
                if args.design == "random"
                else STUDY_OUT.with_name(f"coverage_population_{args.design}.json")
            )
            rows = coverage_study(
                results,
                args.sizes,
                args.draws,
                args.resamples,
                drivers=not args.without_drivers,
                numbers=args.numbers,
                parts=args.parts,
                part_draws=args.part_draws,
                part_sizes=args.part_sizes,
                design=args.design,
            )
            body = {"meta": meta, "rows": rows, "certified_from": certified_from(rows)}
            print(study_table(rows))
        elif args.command == "optimism":
            meta.update(pool_size=args.pool_size, n=args.n, pools=args.pools)
            args.result = args.result or STUDY_OUT.with_name(
                f"coverage_optimism_{args.pool_size}.json"
            )
            rows = optimism_study(
                results,
                args.pool_size,
                args.n,
                args.pools,
                args.draws,
                args.resamples,
                args.numbers,
            )
            body = {"meta": meta, "rows": rows}
        else:
            pairs = [tuple(int(x) for x in p.split(",")) for p in args.pairs]

            def store(rows: list[dict[str, Any]]) -> None:  # after each pair: resumable reading
                text = json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
                atomic_write(args.result, text.encode())

            rows = compare_study(
                results, pairs, args.draws, args.resamples, drivers=args.drivers, on_row=store
            )
            body = {"meta": meta, "rows": rows}
        meta["wall_s"] = time.perf_counter() - start
        atomic_write(args.result, (json.dumps(body, indent=1) + "\n").encode())
        print(json.dumps(meta))


def _load_benchmark(name: str) -> Any:
    """Another script of this folder as a module (``coverage.py`` by path: the name
    ``coverage`` is also the coverage.py package's), loaded once per process."""
    if (loaded := sys.modules.get(f"cw_lens_benchmarks_{name}")) is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(
        f"cw_lens_benchmarks_{name}", Path(__file__).with_name(f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
