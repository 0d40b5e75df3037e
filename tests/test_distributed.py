"""Resuming under torchrun: every rank loads or computes each step alike, whatever the timing.

Two gloo processes run two steps of a job: "quick" (no collectives, so rank 0 can finish and
store it before a slow rank 1 even looks) and "merged" (an all-gather). Rank 1 arrives late. If
each rank decided on its own whether to load a step, rank 1 would find "quick" on disk, skip
its barrier and meet rank 0 in a different collective: a deadlock that, with PyTorch's
30-minute default timeout, ended a CI run. Here the process group times out after 20 s instead.

`run_figures` destroys the process group it created when the job ends, and outside a group
`is_main_process` reads torchrun's `RANK`: the ranks still tell themselves apart afterwards.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from cw_lens.data.distributed import merge_across_ranks
from cw_lens.reproduction.job import Job, JobConfig


class _Count:
    def __init__(self, n: int) -> None:
        self.n = n

    def merge(self, other: _Count) -> None:  # in place, as the accumulators do
        self.n += other.n


def _quick(job: Job) -> str:
    return "stored by rank 0"


def _merged(job: Job) -> int:
    return merge_across_ranks(_Count(dist.get_rank() + 1)).n


def _run_two_steps(rank: int, store: str, out: str, delay: float, errors: str) -> None:
    # a native abort (CI once saw rank 1 end with SIGABRT, "terminate called without an active
    # exception") prints every thread's Python stack into the captured stderr
    faulthandler.enable(all_threads=True)
    try:
        # a file store: no TCP port to race other tests for, and no store server that lives
        # in rank 0 and goes away with it
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=20),
        )
        job = Job(JobConfig(model="testing:tiny-llama"), Path(out), progress=False)
        if rank == 1:
            time.sleep(delay)
        quick = job.step("quick", _quick)
        merged = job.step("merged", _merged)
        assert (quick, merged) == ("stored by rank 0", 3), (quick, merged)
        dist.barrier()
    except BaseException as error:  # reported to the parent, which asserts on it
        Path(errors, f"rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # done and reported: leave without the interpreter's teardown, where gloo's threads are
    # PyTorch's business and not what this test checks
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_a_late_rank_computes_the_step_rank_0_has_just_stored(tmp_path):
    errors = tmp_path / "errors"
    errors.mkdir()
    for attempt in ("fresh", "resumed"):  # the second run loads both steps on both ranks
        mp.spawn(
            _run_two_steps,
            args=(str(tmp_path / f"store-{attempt}"), str(tmp_path / "out"), 2.0, str(errors)),
            nprocs=2,
            join=True,
        )
        assert not list(errors.iterdir()), (attempt, [p.read_text() for p in errors.iterdir()])
    stored = sorted(p.name for p in (tmp_path / "out" / ".state").rglob("*.safetensors"))
    assert stored == ["merged.safetensors", "quick.safetensors"]


def test_outside_a_group_only_torchrun_s_rank_makes_a_process_not_the_main_one(monkeypatch):
    """After the job destroys its group, torchrun's `RANK` (with `WORLD_SIZE` > 1) tells rank 1
    it is not the main process; a `RANK` without torchrun's `WORLD_SIZE` changes nothing, so a
    stray variable never stops a single process from writing its files."""
    from cw_lens.data.distributed import is_main_process

    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "1")
    assert is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not is_main_process()
    monkeypatch.setenv("RANK", "0")
    assert is_main_process()
