"""The main job's stored steps: one file per step under `<out>/.state/<fingerprint>/`, the
record of what each was computed from, and the digest that proves it.

A stored step is reused only when it proves it belongs to the run: its file records what it was
computed from (`step_key`: the step, the run's settings and cw_lens version, its inputs — the
weights' and corpus windows' records — and the digests of the steps it reads) and a SHA-256 over
that record, the file's other metadata and its tensors (`step_digest`). A file whose record is
not this run's (another seed's step copied in, another version's), whose content does not match
its digest (edited) or that records none is recomputed, and the run says why. The digest proves
that a file is what cw_lens wrote for these settings, not who wrote it: anyone can compute it.
The state folder (`<out>/.state`) and what is in it are never followed through a symbolic link.
Every file is written atomically (`cw_lens.core.partial_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cw_lens.core.errors import InputError
from cw_lens.core.partial_files import write_atomically

MISSING = object()  # no stored step is used
# Per state folder: the seconds each step took when it was computed, so that a run that loads
# its steps reports how long they took to compute.
TIMINGS_FILE = "timings.json"
MAX_TIMINGS_BYTES = 1 << 20
STATE_FOLDER = ".state"  # inside --out: the stored steps, one folder per fingerprint
STEP_SUFFIX = ".safetensors"
# a stored step's metadata entries: the record it was computed from, and the digest over it,
# the file's other metadata and its tensors
STEP_KEY = "step_key"
STEP_DIGEST = "step_digest"


def refuse_link(path: Path, what: str) -> None:
    """Refuse `path` when it is a symbolic link: cw_lens keeps its state in the output folder.

    Args:
        path: A path of the state folder.
        what: What it holds, for the message.

    Raises:
        InputError: when `path` is a link, naming it, where it points and the fix.
    """
    if path.is_symlink():
        raise InputError(
            f"{path} is a symbolic link (to {os.readlink(path)!r}): cw_lens keeps {what} in "
            "a folder of its own inside --out and never follows a link out of it. Remove the "
            "link (the steps it held are recomputed) or choose another --out."
        )


def state_root(out: Path) -> Path:
    """`<out>/.state`, the folder of the stored steps, checked to be no link (`refuse_link`).

    Args:
        out: The output folder.

    Returns:
        The state folder's path (it may not exist yet).
    """
    root = out / STATE_FOLDER
    refuse_link(root, "its stored steps")
    return root


def timings_problem(timings: Any) -> str | None:
    """Why `timings.json`'s content is not a record of seconds per step (None: it is one).

    Args:
        timings: The parsed JSON.

    Returns:
        The problem, or None.

    Examples:
        >>> timings_problem({"sinks": 2.5}) is None, timings_problem([1])
        (True, 'expected an object {step: seconds}, got a list')
    """
    if not isinstance(timings, dict):
        return f"expected an object {{step: seconds}}, got a {type(timings).__name__}"
    for name, seconds in timings.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            return f"{name[:40]!r}: expected seconds, got a {type(seconds).__name__}"
        if not 0 <= seconds < 1e12:  # NaN too
            return f"{name[:40]!r}: expected seconds, got {seconds!r:.40}"
    return None


def file_digest(path: Path, key: Mapping[str, Any]) -> tuple[dict[str, str], str]:
    """The digest of a stored step at `path` for the record `key`: a SHA-256 over `key`, the
    file's metadata but its recorded digest, and each tensor's name, dtype, shape and bytes.

    Args:
        path: A safetensors file.
        key: The record (`Job.step_key`).

    Returns:
        The file's metadata and the digest (64 hex digits).

    Raises:
        InputError: when the file is not a readable safetensors file.
    """
    import torch
    from safetensors import SafetensorError, safe_open

    digest = hashlib.sha256()

    def update(part: Any) -> None:  # bytes, each part length-prefixed: no two inputs hash alike
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)

    update(json.dumps(key, sort_keys=True).encode())
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            entries = {k: v for k, v in metadata.items() if k != STEP_DIGEST}
            update(json.dumps(entries, sort_keys=True).encode())
            for name in sorted(f.keys()):
                tensor = f.get_tensor(name)
                update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
                update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(f"{path} is not a readable safetensors file ({exc}).") from None
    return metadata, digest.hexdigest()


def store_step(path: Path, value: Any, key: Mapping[str, Any]) -> None:
    """Write a step's value to `path` atomically, with its record `key` and the digest over
    both (`file_digest`) in its metadata.

    Args:
        path: The step's file.
        value: What the step stores.
        key: What it was computed from (`Job.step_key`).
    """
    from safetensors.torch import load_file, save_file

    from cw_lens.core.saving import STEP_FORMAT, write_file

    def write(tmp: Path) -> None:
        write_file(value, tmp, file_format=STEP_FORMAT, **{STEP_KEY: json.dumps(key)})
        metadata, digest = file_digest(tmp, key)
        # the same tensors and metadata again, now with the digest over them
        save_file(load_file(str(tmp)), str(tmp), metadata={**metadata, STEP_DIGEST: digest})

    write_atomically(path, write)


def load_step(path: Path, key: Mapping[str, Any] | None = None) -> tuple[Any, str | None]:
    """The stored step at `path`, when it carries the record `key` and its content matches the
    digest recorded with it (`verified_step`).

    Args:
        path: The step's file.
        key: The record it must carry (`Job.step_key`); None: the one it carries, which then
            proves only that the file is as cw_lens wrote it, not which run it belongs to.

    Returns:
        `(value, None)`, or `(MISSING, why)` when it is not used (`why` None: no file).
    """
    from cw_lens.core.loading import read_file
    from cw_lens.core.saving import STEP_FORMAT

    if not path.exists():
        return MISSING, None
    digest, why = verified_step(path, key)
    if digest is None:
        return MISSING, why
    try:
        return read_file(path, file_format=STEP_FORMAT), None
    except (InputError, OSError) as exc:
        return MISSING, str(exc)


def recorded_digest(path: Path) -> str | None:
    """The digest a stored step records (`store_step`), or None.

    Args:
        path: The step's file.

    Returns:
        Its `step_digest` entry.
    """
    from cw_lens.core.loading import read_metadata
    from cw_lens.core.saving import STEP_FORMAT

    try:
        return read_metadata(path, file_format=STEP_FORMAT).get(STEP_DIGEST)
    except (InputError, OSError):
        return None


def verified_step(path: Path, key: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """Whether the stored step at `path` was computed from `key` and is as cw_lens wrote it.

    Args:
        path: The step's file.
        key: This run's record of the step (`Job.step_key`); None: the record it carries.

    Returns:
        `(digest, None)` when its record is `key` and its digest matches its content, else
        `(None, why)`.
    """
    from cw_lens.core.loading import read_metadata
    from cw_lens.core.saving import STEP_FORMAT

    try:
        metadata = read_metadata(path, file_format=STEP_FORMAT)
        recorded = metadata.get(STEP_DIGEST)
        if recorded is None or STEP_KEY not in metadata:
            return None, (
                "it records no digest of what it was computed from (written by cw_lens 0.4.1 "
                "or earlier, or not by cw_lens)"
            )
        try:
            stored_key = json.loads(metadata[STEP_KEY])
        except (ValueError, RecursionError):
            return None, "its record of what it was computed from is not readable"
        if key is None:
            key = stored_key
        elif stored_key != key:
            return None, key_difference(stored_key, key)
        if file_digest(path, key)[1] != recorded:
            return None, (
                "its content does not match the digest recorded with it (edited after cw_lens "
                "wrote it?)"
            )
    except (InputError, OSError) as exc:
        return None, str(exc)
    return recorded, None


def key_difference(stored: Any, key: Mapping[str, Any]) -> str:
    """What differs between a stored step's record and this run's (`Job.step_key`).

    Args:
        stored: The record the file carries (parsed JSON, possibly anything).
        key: This run's.

    Returns:
        The reason, naming the settings or inputs that differ.

    Examples:
        >>> key = {"step": "sinks", "settings": {"seed": 0, "version": "1"}, "inputs": {},
        ...        "needs": {}}
        >>> key_difference({**key, "settings": {"seed": 1, "version": "1"}}, key)
        'it was computed with other settings: seed 1 there, 0 here'
    """
    if not isinstance(stored, dict):
        return "its record of what it was computed from is damaged"

    def short(value: Any) -> str:
        return repr(value)[:40]

    def differing(part: str) -> list[str]:
        there, here = stored.get(part), key[part]
        if not isinstance(there, dict):
            return ["(the whole record)"]
        return sorted(k for k in set(there) | set(here) if there.get(k) != here.get(k))

    if stored.get("step") != key["step"]:
        return f"it is the stored step {short(stored.get('step'))}, not {key['step']!r}"
    names = differing("settings")
    if names == ["version"]:
        return (
            f"it was computed by cw_lens {short(stored['settings'].get('version'))}, this is "
            f"{key['settings']['version']}"
        )
    if names:
        there = stored.get("settings")
        there = there if isinstance(there, dict) else {}
        pairs = [
            f"{k} {short(there.get(k))} there, {short(key['settings'].get(k))} here"
            for k in names[:4]
        ]
        return "it was computed with other settings: " + "; ".join(pairs)
    names = differing("inputs")
    if names:
        return f"it was computed on other inputs: {', '.join(map(short, names[:4]))}"
    if differing("needs"):
        return f"the steps it reads changed since: {', '.join(key['needs'])}"
    return "its record of what it was computed from is not this run's"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a partial file in the same folder and a rename
    (`cw_lens.core.partial_files.write_atomically`).

    Args:
        path: The file to write.
        data: Its bytes.
    """

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    write_atomically(path, write)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically, as `atomic_write_bytes` does.

    Args:
        path: The file to write.
        text: Its text.
    """
    atomic_write_bytes(path, text.encode("utf-8"))
