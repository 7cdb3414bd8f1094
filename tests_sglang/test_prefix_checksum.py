"""SGLang's decode-side prefix (``decode_prefix_len``) and its KV checksum row through the
pdflow backend, driven as SGLang's queues drive a backend (``driver.py``, two processes over
Mooncake TCP).

* Prefix: the decode already holds the first 2 of every room's 4 pages; it publishes only the
  other 2 with ``send_metadata(..., decode_prefix_len=8)``; the prefill learns it from
  ``pop_decode_prefix_len()`` (as ``finalize_bootstrap`` does), ``init``s and sends only the
  pages after it, and every landed page holds the room's pages 2 and 3.
* Checksum: SGLang's ``MetadataBuffers`` with its checksum row; the prefill writes a digest
  and layout signature as ``set_kv_checksum`` does, and the decode reads them back with
  ``get_kv_checksum`` from the landed row; ``should_verify_kv_checksum`` says the scheduler's
  ``_verify_kv_checksums`` may compare it (same TP width; ``test_tp.py`` has the other case).
"""

from __future__ import annotations

from tests_sglang.test_driver import OUT, run_pair

ROOMS = 32


def test_prefix_and_checksum_through_the_pdflow_backend() -> None:
    result = run_pair("pdflow", ROOMS, OUT / "logs", both=("--kv-checksum",),
                      decode_only=("--decode-prefix-pages", "2"))  # fmt: skip
    assert result["success"] == ROOMS, result
    assert result["wrong_pages"] == 0  # the decode's 2 pages hold the room's pages 2 and 3
    assert result["prefix_pages"] == [2]  # pop_decode_prefix_len gave the decode's prefix
    # 2 layers x K/V x 2 pages (of 4) x (4 tokens x 2 heads x 16 floats x 4 B)
    assert result["bytes_per_room"] == [2 * 2 * 2 * 4 * 2 * 16 * 4]
    assert result["wrong_aux"] == 0  # first token, room id, digest and signature landed
    assert result["checksum_verified"] == ROOMS


def test_sglang_mooncake_backend_takes_the_same_prefix_and_checksum() -> None:
    """The driver's prefix and checksum calls are SGLang's: its own backend passes them."""
    result = run_pair("mooncake", 8, OUT / "logs", both=("--kv-checksum",),
                      decode_only=("--decode-prefix-pages", "2"))  # fmt: skip
    assert result["success"] == 8 and result["wrong_pages"] == result["wrong_aux"] == 0, result
    assert result["prefix_pages"] == [2]
