"""Partial files: how cw_lens writes a file atomically, and the cleanup that removes the partial
files a killed run left behind.

Every file cw_lens writes atomically (the main job's steps, `summary.json`, `REPORT.md`,
`replicates.npz`, the figures) is written first to a partial file beside it, then renamed over
it (`os.replace`), so a reader never sees half a file. A partial file's name carries a marker no
other program writes, a random id and the file's own name:

    .cw_lens-partial-<32 hex digits>-<name>.tmp

`remove_partial_files` removes only files whose whole name has that form, in the one folder it
is given and never below it: a user's `.notes.tmp.md`, `.backup.tmp.tar` or `config/.env.tmpl`
is never touched, nor a file another program left under an old cw_lens temporary name.

Example:

    from cw_lens.core.partial_files import write_atomically
    write_atomically(Path("out/summary.json"), lambda tmp: tmp.write_text("{}"))
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

PARTIAL_MARKER = ".cw_lens-partial-"
PARTIAL_SUFFIX = ".tmp"
# the whole name: the marker, a uuid4's 32 hex digits, the file's name, the suffix
PARTIAL_NAME = re.compile(
    re.escape(PARTIAL_MARKER) + r"[0-9a-f]{32}-.+" + re.escape(PARTIAL_SUFFIX), re.DOTALL
)


def partial_path(path: Path) -> Path:
    """A fresh partial file's path for `path`, in the same folder (so the rename is atomic).

    Args:
        path: The file to be written.

    Returns:
        `<folder>/.cw_lens-partial-<random id>-<name>.tmp`, a name no other writer uses.

    Examples:
        >>> name = partial_path(Path("out/summary.json")).name
        >>> is_partial(name), name.endswith("-summary.json.tmp")
        (True, True)
    """
    return path.with_name(f"{PARTIAL_MARKER}{uuid.uuid4().hex}-{path.name}{PARTIAL_SUFFIX}")


def is_partial(name: str) -> bool:
    """Whether a file name is one `partial_path` gives.

    Args:
        name: A file name (no folder).

    Returns:
        True for cw_lens's partial files only.

    Examples:
        >>> is_partial(".notes.tmp.md"), is_partial(".summary.json.tmp-123")
        (False, False)
    """
    return PARTIAL_NAME.fullmatch(name) is not None


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write `path` atomically: `write` fills a partial file beside it, which is then renamed
    over `path` (replacing a file there, or a link, never writing through one); on an error
    the partial file is removed and the error raised.

    Args:
        path: The file to write; its folder is created if missing.
        write: Writes the file's content to the path it is given.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_partial_files(folder: Path) -> int:
    """Remove the partial files (`is_partial`) directly in `folder`, not below it.

    Args:
        folder: A folder cw_lens writes into (missing: nothing to remove).

    Returns:
        How many were removed.
    """
    if not folder.is_dir():
        return 0
    n = 0
    for entry in os.scandir(folder):
        # a link is removed as a link (never followed); a folder of that name is left alone
        if is_partial(entry.name) and not entry.is_dir(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            n += 1
    return n
