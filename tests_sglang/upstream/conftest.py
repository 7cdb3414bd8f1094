"""SGLang's own unit tests of its disaggregation queues, run with pdflow's plugin loaded.

SGLang's test files are not part of pdflow (their code stays SGLang's): copy them in from an
SGLang clone (``test/registered/unit/disaggregation/test_*.py``, of v0.5.23 or of the commits
docs/sglang.md names), ``pip install datasets`` into ``.venv-sglang`` and run
``.venv-sglang/bin/pytest -p no:cacheprovider -q -rA tests_sglang/upstream``; remove them
afterwards (``make test-sglang`` would run them too). ``.gitignore`` keeps them out of
pdflow's commits. docs/sglang.md ("SGLang's own unit tests") has the exact commands, which
files were run here with their results with and without the plugin, and which cannot take the
pdflow backend and why.

Before any of them is collected, SGLang's plugins are loaded exactly as SGLang loads them in
every process (``sglang.srt.plugins.load_plugins``), so each runs against SGLang with ``pdflow``
registered: its ``TransferBackend``, ``get_kv_class`` and ``DecodeTransferQueue._defer_release``
are the plugin's. A session that did not end up with the plugin applied fails here rather than
passing against plain SGLang.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure() -> None:
    if not any(Path(__file__).parent.glob("test_*.py")):
        return  # nothing copied in: leave the other SGLang tests' plugin loading alone
    from sglang.srt.disaggregation import decode, utils
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if not hasattr(utils.TransferBackend, "PDFLOW"):
        raise RuntimeError(
            "pdflow's SGLang plugin did not load (no TransferBackend.PDFLOW): install pdflow in "
            "this env (scripts/setup_sglang.sh) and unset SGLANG_PLUGINS or include pdflow in it"
        )
    from pdflow.sglang.plugin import hold_until_pdflow_releases

    closure = getattr(decode.DecodeTransferQueue._defer_release, "__closure__", None) or ()
    if not any(cell.cell_contents is hold_until_pdflow_releases for cell in closure):
        raise RuntimeError("pdflow's release hook is not on DecodeTransferQueue._defer_release")
