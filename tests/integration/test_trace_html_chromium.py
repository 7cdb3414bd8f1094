"""The HTML timeline renders in a real headless Chromium, offline, with the rooms drawn."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pdflow.cli import main
from tests.unit.trace_fixtures import SCRIPTS, record_world

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,900",
]  # fmt: skip

pytestmark = pytest.mark.integration


def _chromium(tmp_path: Path, *args: str) -> str:
    profile = tmp_path / "profile"
    result = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_page_renders_rooms_and_swimlanes(tmp_path: Path) -> None:
    trace = record_world(tmp_path / "world.jsonl", SCRIPTS * 2)
    page = tmp_path / "timeline.html"
    assert main(["trace", "show", str(trace), "--html", str(page), "--room", "2"]) == 0
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)=["']https?:""", html), "the page must not load anything"
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    rooms = len(SCRIPTS) * 2
    for room in range(1, rooms + 1):
        assert f'id="room-{room}"' in dom, f"room {room} missing from the list"
    assert f"{rooms} of {rooms} rooms match" in dom
    assert re.search(r'<svg[^>]*id="swimlanes"[^>]*data-room="2"', dom)
    lanes = re.findall(r'class="lane-title"[^>]*>([^<]+)<', dom)
    assert lanes == ["prefill-0", "decode-0"]
    # Room 2 is an aborted room: its fence, the ABORT and the drain ACK are all drawn.
    assert "fence armed" in dom and "sends abort to prefill-0" in dom
    assert "received abort_ack" in dom and dom.count('marker-end="url(#arrow)"') >= 3
    screenshot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={screenshot}", page.as_uri())
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 20_000  # a drawn page, not a blank one
