"""(a) The plugin: SGLang accepts ``--disaggregation-transfer-backend pdflow`` and every
``get_kv_class`` caller gets pdflow's classes, while the other backends are untouched."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings

import pytest

from tests_sglang.driver import MODEL_DIR

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Every module that builds TransferBackend from the flag or calls get_kv_class (0.5.23).
CALLERS = [
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.disagg_service",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.multi_tokenizer_mixin",
]


@pytest.fixture(scope="module")
def plugins_loaded() -> None:
    from sglang.srt.plugins import load_plugins

    for name in CALLERS:
        importlib.import_module(name)  # imported before the plugin runs, as in a scheduler
    load_plugins()


def test_pdflow_is_an_accepted_transfer_backend(plugins_loaded: None) -> None:
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    assert "pdflow" in DISAGG_TRANSFER_BACKEND_CHOICES
    args = ServerArgs(model_path=str(MODEL_DIR), skip_tokenizer_init=True, device="cpu",
                      disaggregation_mode="prefill",
                      disaggregation_transfer_backend="pdflow")  # fmt: skip
    assert args.disaggregation_transfer_backend == "pdflow"
    cli = prepare_server_args(["--model-path", str(MODEL_DIR), "--device", "cpu",
                               "--disaggregation-mode", "decode",
                               "--disaggregation-transfer-backend", "pdflow"])  # fmt: skip
    assert cli.disaggregation_transfer_backend == "pdflow"


def test_every_get_kv_class_caller_gets_pdflow_classes(plugins_loaded: None) -> None:
    from pdflow.sglang import conn

    expected = {
        "MANAGER": conn.PdflowKVManager,
        "SENDER": conn.PdflowKVSender,
        "RECEIVER": conn.PdflowKVReceiver,
        "BOOTSTRAP_SERVER": conn.PdflowKVBootstrapServer,
    }
    for name in CALLERS:
        module = importlib.import_module(name)
        backend = module.TransferBackend("pdflow")  # as the scheduler builds it from the flag
        if hasattr(module, "get_kv_class"):
            kinds = module.KVClassType
            for kind, cls in expected.items():
                assert module.get_kv_class(backend, kinds[kind]) is cls, (name, kind)
            from sglang.srt.disaggregation.base.conn import KVArgs

            assert module.get_kv_class(backend, kinds.KVARGS) is KVArgs


def test_other_backends_are_untouched(plugins_loaded: None) -> None:
    from sglang.srt.disaggregation.fake import FakeKVManager, FakeKVSender
    from sglang.srt.disaggregation.mooncake import (
        MooncakeKVBootstrapServer,
        MooncakeKVManager,
        MooncakeKVReceiver,
    )
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.managers.disagg_service import rust_server_serves_kv_bootstrap

    mooncake = TransferBackend("mooncake")
    assert get_kv_class(mooncake, KVClassType.MANAGER) is MooncakeKVManager
    assert get_kv_class(mooncake, KVClassType.RECEIVER) is MooncakeKVReceiver
    assert get_kv_class(mooncake, KVClassType.BOOTSTRAP_SERVER) is MooncakeKVBootstrapServer
    fake = TransferBackend.FAKE
    assert get_kv_class(fake, KVClassType.MANAGER) is FakeKVManager
    assert get_kv_class(fake, KVClassType.SENDER) is FakeKVSender
    assert get_kv_class(fake, KVClassType.BOOTSTRAP_SERVER) is None
    assert [b.value for b in TransferBackend] == ["mooncake", "mori", "nixl", "ascend", "fake",
                                                  "pdflow"]  # fmt: skip
    # pdflow brings its own registry: SGLang's Rust server must not stand in for it.
    assert rust_server_serves_kv_bootstrap("mooncake")
    assert not rust_server_serves_kv_bootstrap("pdflow")


def test_the_deferred_release_hook_is_applied(plugins_loaded: None) -> None:
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    from pdflow.sglang.plugin import hold_until_pdflow_releases

    wrapper = DecodeTransferQueue._defer_release
    assert getattr(wrapper, "__wrapped__", None) is not None
    assert wrapper.__closure__ is not None
    assert any(cell.cell_contents is hold_until_pdflow_releases for cell in wrapper.__closure__)


def test_without_the_plugin_sglang_refuses_pdflow() -> None:
    """The check above would pass vacuously if SGLang accepted any name: it does not."""
    code = (
        "import warnings; warnings.filterwarnings('ignore')\n"
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        f"prepare_server_args(['--model-path', {str(MODEL_DIR)!r}, '--device', 'cpu',"
        " '--disaggregation-mode', 'decode', '--disaggregation-transfer-backend', 'pdflow'])\n"
    )
    env = {**os.environ, "SGLANG_PLUGINS": "some-other-plugin"}  # SGLang's plugin allow-list
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert "invalid choice: 'pdflow'" in result.stderr


def _resolved(**fields: object) -> object:
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(MODEL_DIR), skip_tokenizer_init=True, device="cpu",
                      disaggregation_decode_allocation_policy="prefill_complete",
                      **fields)  # fmt: skip
    args.resolve_once()  # SGLang's resolution pipeline, where the policy is validated
    return args


def test_prefill_complete_accepts_pdflow_and_keeps_sglangs_other_refusals(
    plugins_loaded: None,
) -> None:
    for mode in ("prefill", "decode"):
        _resolved(disaggregation_mode=mode, disaggregation_transfer_backend="pdflow")
    with pytest.raises(ValueError, match="does not yet support pipeline") as refused:
        _resolved(disaggregation_mode="prefill", disaggregation_transfer_backend="pdflow",
                  pp_size=2)  # fmt: skip
    assert "Mooncake" not in str(refused.value)
    # Other backends keep SGLang's refusal.
    with pytest.raises(ValueError, match="transfer backends other than Mooncake"):
        _resolved(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl")


def test_the_backend_stages_small_rooms_unless_the_deployment_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdflow.io.settings import load_settings
    from pdflow.sglang import conn

    monkeypatch.delenv("PDFLOW_SMALL_ROOM_STAGING_BYTES", raising=False)
    chosen = conn._small_room_staging_default()
    assert chosen == conn.SMALL_ROOM_STAGING_BYTES == 16384
    assert load_settings(small_room_staging_bytes=chosen).small_room_staging_bytes == 16384
    monkeypatch.setenv("PDFLOW_SMALL_ROOM_STAGING_BYTES", "0")
    kept = conn._small_room_staging_default()
    assert load_settings(small_room_staging_bytes=kept).small_room_staging_bytes == 0
