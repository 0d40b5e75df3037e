"""Two torchrun-style ranks (gloo processes) run the four corpus analyses in one pass and reduce
their accumulators with collectives: every table equals the single-process run's within the float64
tolerance (the sums of two shards are added in another order; histogram counts and the factor
sample are equal exactly)."""

from __future__ import annotations

import datetime
import io
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cw_lens
from cw_lens import reproduction
from cw_lens.models.testing import tiny_llama
from cw_lens.reproduction.bootstrap import Bootstrap

pytestmark = pytest.mark.slow
TEXTS = [
    "The sink holds the attention of every later token in the layer.",
    "Values of weak tokens drift in cones.",
    "A retriever head copies one token; a mixer blends many of them together here.",
    "Pruning removes the heads whose contribution is smallest.",
    "Short one.",
    "Long documents and short documents share a batch, padded on the right side always.",
]
OPTIONS = dict(batch_size=2, per_document=True, progress=False)
# float64 sums of the same float32 blocks, added in another order (15 digits written)
RTOL = 1e-10


def _tables() -> dict[str, pd.DataFrame]:
    torch.manual_seed(0)
    model = tiny_llama()
    results = cw_lens.corpus_analyses(
        model,
        TEXTS,
        analyses={"sinks": {"min_query": 2}, "selection": {}, "taxonomy": {}, "ablation": {}},
        **OPTIONS,
    )
    return {
        "sink_heads": results.sinks.heads(),
        "sink_samples": results.sinks.samples("tail"),
        "sink_replicates": pd.DataFrame(
            {
                k: v.flatten().numpy()
                for k, v in reproduction.replicates(results.sinks, Bootstrap(resamples=20))[
                    0
                ].items()
                if v.ndim == 1
            }
        ),
        "selection": results.selection.to_dataframe(),
        "taxonomy": results.taxonomy.to_dataframe(),
        "ablation": results.ablation.to_dataframe(),
    }


def _on_rank(rank: int, store: str, out: str) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=120),
        )
        for name, table in _tables().items():
            table.to_json(Path(out, f"rank{rank}-{name}.json"), orient="split", double_precision=15)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_ranks_reduce_to_the_single_process_tables(tmp_path):
    single = _tables()
    mp.start_processes(
        _on_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in (0, 1):
        for name, want in single.items():
            got = pd.read_json(tmp_path / f"rank{rank}-{name}.json", orient="split")
            want = pd.read_json(
                io.StringIO(want.to_json(orient="split", double_precision=15)), orient="split"
            )
            pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=RTOL, atol=1e-12)
