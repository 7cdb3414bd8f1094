"""`pdflow bench --quick` end to end: real suites, real Mooncake TCP on loopback, files written."""

import json
from pathlib import Path

import pytest
import structlog
from PIL import Image

from pdflow.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_quick_core_and_hetero_write_json_and_png(tmp_path: Path) -> None:
    logging_before = structlog.get_config()
    code = main(
        ["bench", "--quick", "--suite", "core", "--suite", "hetero", "--out", str(tmp_path)]
    )
    assert code == 0
    assert structlog.get_config() == logging_before, "bench must restore the logging config"

    document = json.loads((tmp_path / "results.json").read_text())
    assert document["meta"]["quick"] is True
    assert {name: suite["status"] for name, suite in document["suites"].items()} == {
        "core": "ok",
        "hetero": "ok",
    }
    mooncake = document["suites"]["hetero"]["data"]["mooncake"]
    # Quick shape: 4 prefill ranks, 4 layers, 256 tokens = 16 pages of 16 tokens.
    assert mooncake["per_slice"]["measured_layers"] == 1
    assert mooncake["per_slice"]["measured_ops"] == 4 * 2 * 16 * 16
    assert mooncake["per_slice"]["full_shape_ops"] == 4 * 2 * 4 * 16 * 16
    assert mooncake["staged"]["ops"] == 4
    assert mooncake["staged_matches_reference"] is True
    steps = document["suites"]["core"]["data"]["steps"]
    assert steps["handle_calls"] == 12 * steps["rooms"] + 1

    verdicts = {(check["suite"], check["verdict"]) for check in document["checks"]}
    assert {suite for suite, _ in verdicts} == {"core", "hetero"}
    assert all(verdict in ("pass", "miss", "info") for _, verdict in verdicts)

    assert sorted(document["plots"]) == ["core.png", "hetero_tp.png"]
    for name in document["plots"]:
        path = tmp_path / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(path) as image:
            image.load()  # decodes every pixel; raises on a truncated or corrupt file
            assert image.width > 600 and image.height > 300


def test_unknown_suite_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--suite", "warp-drive"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'warp-drive'" in capsys.readouterr().err
