"""Run folders from someone else (issue 51, "Run folders"): `cw-lens compare` reads nothing outside
a run's folder and checks a replicates file's size and hash before it reads it; a raw exception
from a damaged `summary.json` is an `InputError` naming the file and the field; the main job's
resume loads a stored step only when the record and digest it carries are this run's, refuses a
state folder (or a file in it) that is a symbolic link, and deletes only the partial files
cw_lens itself wrote.
"""

from __future__ import annotations

import json
import shutil
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cw_lens
from cw_lens.core.errors import InputError
from cw_lens.reproduction.job import JobConfig, clean_partial_files, run_figures
from cw_lens.reproduction.state import Job

SETTINGS = settings(
    max_examples=60,
    deadline=5000,  # ms per example: a hang fails
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
)
TINY = dict(model="testing:tiny-llama", n_docs=4, max_tokens=24, task=None, batch_size=2)
# files of a user's in --out whose names look like temporary files: a run never deletes them
USERS_FILES = (
    ".env.tmpl",
    ".notes.tmp.md",
    ".backup.tmp.tar",
    "config/.env.tmpl",
    "config/.x.tmp-123",  # named like a cw_lens 0.4.1 temporary file
    "config/.cw_lens-partial-" + "0" * 32 + "-a.json.tmp",  # like a partial file, not at the top
)


# --------------------------------------------------------------------------- what a run opens

OPENED: list[str] | None = None  # the paths opened while `opened_during` records


def _audit(event: str, args: tuple) -> None:
    if event == "open" and OPENED is not None and isinstance(args[0], (str, bytes, Path)):
        OPENED.append(str(Path(args[0] if not isinstance(args[0], bytes) else args[0].decode())))


sys.addaudithook(_audit)  # an audit hook cannot be removed: it records only inside opened_during


def opened_during(call) -> tuple[list[str], BaseException | None]:
    """The files `call()` opened, and what it raised (None if nothing)."""
    global OPENED
    OPENED, raised = [], None
    try:
        call()
    except Exception as exc:  # the caller checks what was raised
        raised = exc
    finally:
        opened, OPENED = OPENED, None
    return opened, raised


# --------------------------------------------------------------------------- cw-lens compare


@pytest.fixture(scope="module")
def run(run_folder):
    """A run folder of `cw-lens compare` (tests/conftest.py)."""
    return run_folder


def _edited(run: Path, target: Path, edit=None, text: str | None = None) -> Path:
    """A copy of `run` at `target` whose summary is `edit(summary)` (or the JSON `text`)."""
    shutil.copytree(run, target)
    summary = json.loads((run / "summary.json").read_text())
    if edit is not None:
        edit(summary)
    (target / "summary.json").write_text(json.dumps(summary) if text is None else text)
    return target


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../../etc/hostname", "link", "../a/x"])
def test_a_replicates_file_outside_the_run_folder_is_refused_unread(run, tmp_path, name):
    outside = tmp_path / "outside.npz"
    outside.write_bytes((run / "replicates.npz").read_bytes())
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"another run's file")
    folder = _edited(run, tmp_path / "b", lambda s: s["replicates"].update(file=name))
    (folder / "link").symlink_to(outside)  # a link inside the folder to a file outside
    opened, raised = opened_during(lambda: cw_lens.compare_runs([run, folder]))
    assert isinstance(raised, InputError), raised
    assert "replicates.file" in str(raised) and str(folder / "summary.json") in str(raised)
    read = {"/etc/passwd", "/etc/hostname", str(outside), str(tmp_path / "a" / "x")}
    assert not read & set(opened), opened


def test_an_oversized_replicates_file_is_refused_before_it_is_read(run, tmp_path):
    """A file of 2 GiB (sparse: no disk used), or of another size than its summary records, is
    refused from its size alone, whatever SHA-256 the summary gives."""
    big = _edited(run, tmp_path / "big", lambda s: s["replicates"].update(sha256="0" * 64))
    with open(big / "replicates.npz", "r+b") as f:
        f.truncate(2 << 30)
    real = (run / "replicates.npz").stat().st_size
    sized = _edited(run, tmp_path / "sized", lambda s: s["replicates"].update(bytes=real + 1))
    for folder in (big, sized):
        opened, raised = opened_during(lambda f=folder: cw_lens.compare_runs([run, f]))
        assert isinstance(raised, InputError) and "was not read" in str(raised), raised
        assert str(folder / "replicates.npz") not in opened


def test_a_replicates_file_is_hashed_as_it_is_streamed(run, tmp_path):
    """A file within the bound but with another SHA-256 is refused after hashing it in chunks:
    it is never held whole."""
    folder = _edited(run, tmp_path / "b")
    with open(folder / "replicates.npz", "r+b") as f:
        f.truncate(48 << 20)  # 48 MiB, most of it a sparse tail: the digest differs
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="does not belong to the summary"):
            cw_lens.compare_runs([run, folder])
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB held to check a hash"


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# each edit of summary.json (the JSON text) and the field its error must name
RAW = {
    "file is a number": (lambda t: t.replace('"file": "replicates.npz"', '"file": 5'),
                         "replicates.file"),
    "sha256 is a number": (lambda t: t.replace('"sha256": "', '"sha256": 5, "x": "'),
                           "replicates.sha256"),
    "a value of 10^400": (lambda t: t.replace('"value": 1.0', '"value": 1' + "0" * 400),
                          "(its value)"),
    "a float beyond range": (lambda t: t.replace('"value": 1.0', '"value": 1e400'),
                             "(its value)"),
    "a threshold of -10^400": (lambda t: t.replace('"threshold": 0.0',
                                                   '"threshold": -1' + "0" * 400),
                               "(its threshold)"),
    "a 5000-digit count": (lambda t: t.replace('"model": "m"', '"model": "m", "n_documents": '
                                               + "9" * 5000), "'n_documents'"),
    "a count that is text": (lambda t: t.replace('"model": "m"', '"model": "m", "seed": "0"'),
                             "'seed'"),
    "nesting 10^5 deep": (lambda t: t.replace('"model": "m"', f'"model": {_deep(100_000)}'),
                          "nested too deep"),
    "a number's name nested 500 deep": (lambda t: t.replace('"number": "x"',
                                                            f'"number": {_deep(500)}'),
                                        "the number's name"),
}  # fmt: skip


@pytest.mark.parametrize("case", RAW)
def test_a_damaged_summary_is_an_input_error_naming_the_file_and_field(run, tmp_path, case):
    edit, field = RAW[case]
    text = (run / "summary.json").read_text()
    assert edit(text) != text, "the edit must change the summary"
    folder = _edited(run, tmp_path / "b", text=edit(text))
    with pytest.raises(InputError) as info:
        cw_lens.compare_runs([run, folder])
    assert str(folder / "summary.json") in str(info.value) and field in str(info.value)
    assert len(str(info.value)) < 2000  # the message shows a hostile value shortened


# --------------------------------------------------------------------------- the job's state


def _job(out: Path, **settings) -> Job:
    return Job(JobConfig(model="testing:tiny-llama", **settings), out)


def _value(seed: int) -> dict:
    return {"x": torch.full((3,), float(seed)), "seed": seed}


def test_a_step_copied_from_another_seeds_run_is_recomputed_and_the_run_says_so(tmp_path, capsys):
    """The seed-1 run's stored step copied under the seed-0 fingerprint is not loaded, nor is
    the copy with its record edited to seed 0 (its digest no longer matches)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    other = _job(tmp_path / "one", seed=1)
    other.step("sinks", lambda job: _value(1))
    copied = other.state_dir / "sinks.safetensors"
    job = _job(tmp_path / "out", seed=0)
    job.state_dir.mkdir(parents=True)
    shutil.copy(copied, job.state_dir / "sinks.safetensors")
    assert job.step("sinks", lambda job: _value(0))["seed"] == 0
    assert "[sinks] stored result not used (it was computed with other settings: seed 1 there, " \
           "0 here); recomputing" in capsys.readouterr().err  # fmt: skip
    # the copy again, its record now naming seed 0
    with safe_open(str(copied), framework="pt") as f:
        metadata = f.metadata()
    record = json.loads(metadata["step_key"])
    record["settings"]["seed"] = 0
    save_file(load_file(str(copied)), str(job.state_dir / "sinks.safetensors"),
              metadata={**metadata, "step_key": json.dumps(record)})  # fmt: skip
    again = _job(tmp_path / "out", seed=0)
    assert again.step("sinks", lambda job: _value(0))["seed"] == 0
    assert "does not match the digest recorded with it" in capsys.readouterr().err
    # what the run itself stored is loaded again
    assert _job(tmp_path / "out", seed=0).step("sinks", lambda job: 1 / 0)["seed"] == 0


def test_a_step_computed_on_other_inputs_or_from_another_upstream_step_is_recomputed(tmp_path):
    job = _job(tmp_path)
    job.inputs = {"corpus": {"token_ids_sha256": "a"}}
    job.needs = {"heatmaps": ("sinks",)}
    job.step("sinks", lambda job: _value(0))
    job.step("heatmaps", lambda job: "from sinks 0")
    edited = _job(tmp_path)
    edited.inputs = {"corpus": {"token_ids_sha256": "b"}}  # the corpus file changed
    assert edited.step("sinks", lambda job: _value(5))["seed"] == 5
    # sinks changed: the step that reads it is recomputed too
    edited.needs = {"heatmaps": ("sinks",)}
    assert edited.step("heatmaps", lambda job: "from sinks 5") == "from sinks 5"
    resumed = _job(tmp_path)
    resumed.inputs, resumed.needs = edited.inputs, edited.needs
    assert resumed.step("sinks", lambda job: 1 / 0)["seed"] == 5
    assert resumed.step("heatmaps", lambda job: 1 / 0) == "from sinks 5"


@pytest.mark.parametrize("where", [".state", ".state/fingerprint", "step", "timings"])
def test_a_symlinked_state_folder_or_file_is_refused(tmp_path, where):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    job = _job(out)
    target = {
        ".state": out / ".state",
        ".state/fingerprint": job.state_dir,
        "step": job.state_dir / "sinks.safetensors",
        "timings": job.state_dir / "timings.json",
    }[where]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(elsewhere / "x" if where in ("step", "timings") else elsewhere)
    with pytest.raises(InputError, match="is a symbolic link"):
        _job(out).step("sinks", lambda job: _value(0))
    assert not list(elsewhere.iterdir())
    if where == ".state":  # a run refuses it first thing, before it loads anything
        with pytest.raises(InputError, match="is a symbolic link"):
            run_figures(JobConfig(**TINY), out, progress=False)
        assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("timings", ["[1]", '{"sinks": "1"}', '{"sinks": NaN}', "[[[["])
def test_unusable_step_timings_are_not_used_and_the_run_says_so(tmp_path, capsys, timings):
    _job(tmp_path).step("sinks", lambda job: _value(0))
    job = _job(tmp_path)
    (job.state_dir / "timings.json").write_text(timings)
    assert job.step("sinks", lambda job: 1 / 0)["seed"] == 0  # the step itself is fine
    assert "sinks" not in job.timings
    job.step("ablation", lambda job: _value(2))  # storing a step rewrites the timings
    assert set(json.loads((job.state_dir / "timings.json").read_text())) == {"ablation"}
    assert "[timings]" in capsys.readouterr().err


# --------------------------------------------------------------------------- the main job


@pytest.fixture(scope="module")
def sinks_run(tmp_path_factory):
    """A run of the sinks step on the tiny model, in a folder holding a user's files."""
    out = tmp_path_factory.mktemp("job") / "out"
    for name in USERS_FILES:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(f"the user's {name}")
    summary = run_figures(JobConfig(**TINY), out, progress=False, steps=["sinks"])
    return out, summary


def _copy(out: Path, target: Path) -> tuple[Path, Path]:
    shutil.copytree(out, target, symlinks=True)
    return target, next(target.glob(".state/*/sinks.safetensors"))


def _rewrite(path: Path, content=None, edit=None) -> None:
    """Rewrite a stored step's content (`edit(content JSON)`), keeping its other metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    text = edit(metadata["content"]) if edit is not None else json.dumps(content)
    assert text != metadata["content"]
    save_file(load_file(str(path)), str(path), metadata={**metadata, "content": text})


@pytest.mark.slow
def test_a_users_files_in_out_survive_a_run(sinks_run):
    out, _ = sinks_run
    for name in USERS_FILES:
        assert (out / name).read_text() == f"the user's {name}", name
    assert not [p for p in out.rglob(".cw_lens-partial-*") if p.parent == out]


@pytest.mark.slow
def test_an_edited_threshold_in_a_stored_step_is_recomputed(sinks_run, tmp_path, capsys):
    """The sinks step's `threshold` edited from 0.3 to 0.0: the step is recomputed (the run
    says why), and the claims are the run's own, not numbers from the edited threshold."""
    out, summary = sinks_run
    folder, step = _copy(out, tmp_path / "out")
    _rewrite(step, edit=lambda text: text.replace('"threshold":0.3', '"threshold":0.0'))
    edited = run_figures(JobConfig(**TINY), folder, progress=False, steps=["sinks"])
    assert "[sinks] stored result not used (its content does not match the digest" in (
        capsys.readouterr().err
    )
    assert edited["claims"] == summary["claims"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["written without a digest", "with this run's digest"])
def test_a_stored_step_holding_no_value_of_the_step_is_recomputed(sinks_run, tmp_path, capsys, how):
    """A stored step whose content is `{}`: never a raw KeyError; recomputed, and the run says
    why, even when the file carries this run's record and a matching digest."""
    from cw_lens.core.saving import STEP_FORMAT, write_file

    out, summary = sinks_run
    folder, step = _copy(out, tmp_path / "out")
    if how == "written without a digest":
        write_file({}, step, file_format=STEP_FORMAT)
        expected = "records no digest"
    else:
        from cw_lens.reproduction.stored_steps import store_step

        assert Job(JobConfig(**TINY), folder).state_dir == step.parent
        store_step(step, {}, json.loads(_metadata(step)["step_key"]))  # the run's own record
        expected = "it holds no value of the step 'sinks': expected the keys ['stats']"
    edited = run_figures(JobConfig(**TINY), folder, progress=False, steps=["sinks"])
    assert expected in capsys.readouterr().err
    assert edited["claims"] == summary["claims"]


def _metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


@pytest.mark.slow
def test_unusable_timings_do_not_stop_a_resumed_run(sinks_run, tmp_path, capsys):
    out, summary = sinks_run
    folder, step = _copy(out, tmp_path / "out")
    (step.parent / "timings.json").write_text("[1]")
    assert run_figures(JobConfig(**TINY), folder, progress=False, steps=["sinks"]) == summary
    assert "[timings]" in capsys.readouterr().err


# --------------------------------------------------------------------------- the cleanup


def test_the_cleanup_deletes_only_the_partial_files_cw_lens_wrote(tmp_path):
    out = tmp_path / "out"
    for name in USERS_FILES:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("mine")
    state = _job(out).state_dir
    state.mkdir(parents=True)
    assert clean_partial_files(out) == 0
    assert all((out / name).read_text() == "mine" for name in USERS_FILES)
    from cw_lens.core.partial_files import partial_path

    left = [partial_path(out / "summary.json"), partial_path(state / "sinks.safetensors")]
    for path in left:
        path.write_text("half written")
    assert clean_partial_files(out) == 2
    assert not any(path.exists() for path in left)
    assert all((out / name).read_text() == "mine" for name in USERS_FILES)


PIECES = ["..", ".", "a", "b", "replicates.npz", "", "/", "etc", "hostname", "link", "~", "\\"]


@SETTINGS
@given(
    name=st.one_of(
        st.lists(st.sampled_from(PIECES), max_size=7).map("/".join),
        st.text(max_size=20),
        st.sampled_from([None, 5, 1.5, True, [], {}, ["replicates.npz"]]),
    )
)
def test_a_replicates_file_anywhere_is_read_only_inside_the_run_folder(run, tmp_path, name):
    """Whatever `replicates.file` names, `compare` reads nothing outside the run's folder: it
    compares or refuses with an `InputError`."""
    folder = tmp_path / "b"
    shutil.rmtree(folder, ignore_errors=True)
    _edited(run, folder, lambda s: s["replicates"].update(file=name))
    if not (folder / "link").exists():
        (folder / "link").symlink_to(tmp_path / "outside.npz")
    (tmp_path / "outside.npz").write_bytes((run / "replicates.npz").read_bytes())
    opened, raised = opened_during(lambda: cw_lens.compare_runs([run, folder]))
    assert raised is None or isinstance(raised, InputError), repr(raised)
    outside = [p for p in opened if not (p.startswith(str(folder)) or p.startswith(str(run)))]
    assert not [p for p in outside if p.startswith((str(tmp_path), "/etc"))], outside
