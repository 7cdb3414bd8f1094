"""benchmarks/socket_floor: every kind and idle mode really carries a message, and the allowance
is 0.9x's share of the raw time (few messages: the figures themselves are the benchmark's)."""

import threading

import pytest
from benchmarks import socket_floor
from benchmarks.common import latency_summary


def test_every_kind_after_every_idle_mode_gives_ordered_positive_figures() -> None:
    result = socket_floor.run(messages=5, gap_s=0.0002, raw_ms=0.45)
    assert set(result["floors"]) == {
        f"{kind}/{idle}" for kind in socket_floor.KINDS for idle in socket_floor.IDLES
    }
    for figures in result["floors"].values():
        assert 0 < figures["p10_us"] <= figures["median_us"] <= figures["p90_us"]
    assert result["allowance_us"] == pytest.approx(50.0)
    assert set(result["within_allowance"]) == set(result["floors"])
    # The reader thread of each TCP pair ends with its pair.
    assert not [t for t in threading.enumerate() if t.name == "socket-floor-reader"]


def test_the_message_must_arrive_before_the_time_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    # A one-way time ends only once the whole message is read, and TCP may hand it over in
    # pieces: the same-thread pair must keep reading until all 60 bytes are in.
    reads: list[int] = []
    real_recv = socket_floor.socket.socket.recv

    def one_byte_at_a_time(self: socket_floor.socket.socket, size: int) -> bytes:
        reads.append(size)
        return real_recv(self, 1)

    monkeypatch.setattr(socket_floor.socket.socket, "recv", one_byte_at_a_time)
    socket_floor.measure("tcp", "none", 1, 0.0)
    # 60 bytes, one at a time, for each of the warm-up messages and the measured one.
    assert len(reads) == 60 * (socket_floor.WARM_UP + 1)


def test_bad_arguments_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="choose from zmq, tcp, tcp_thread"):
        socket_floor.measure("udp", "sleep", 5, 0.001)
    with pytest.raises(ValueError, match="choose from sleep, spin, none"):
        socket_floor.measure("zmq", "nap", 5, 0.001)
    with pytest.raises(ValueError, match="at least 1"):
        socket_floor.measure("zmq", "sleep", 0, 0.001)


def test_latency_summary_is_in_microseconds() -> None:
    summary = latency_summary([i / 1e6 for i in range(1, 11)])
    assert summary == {"median_us": pytest.approx(5.5), "p10_us": pytest.approx(2.0),
                       "p90_us": pytest.approx(10.0)}  # fmt: skip
