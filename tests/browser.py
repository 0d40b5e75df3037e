"""Real-browser helpers: Debian's chromium driven by Playwright (no browser download).

Playwright launches ``/usr/bin/chromium`` (``executable_path``) headless with flags that work
offline, each launch with a fresh temporary profile (Playwright's own ``--user-data-dir``).
A missing chromium fails the test with the fix (``apt-get install -y chromium``); it never skips.
Screenshots go under the test's tmp dir, and also into ``$CW_LENS_SCREENSHOT_DIR`` when that is
set (``make screenshots`` regenerates the docs images that way).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium_bin() -> str:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the browser tests need Debian's chromium. Install it with "
            "`apt-get install -y chromium` (as root; `make browser-deps` does), then rerun.",
            pytrace=False,
        )
    return str(CHROMIUM)


def launch(playwright):
    """A headless chromium browser (Debian's binary, offline flags, fresh profile)."""
    return playwright.chromium.launch(executable_path=chromium_bin(), headless=True, args=FLAGS)


def screenshot(page, tmp_path: Path, name: str, **kwargs) -> Path:
    """A PNG of ``page`` under ``tmp_path`` (and in ``$CW_LENS_SCREENSHOT_DIR`` when set)."""
    out = tmp_path / name
    page.screenshot(path=str(out), **kwargs)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    target = os.environ.get("CW_LENS_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, Path(target) / name)
    return out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
