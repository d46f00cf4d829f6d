"""The ports tests and benchmarks hand to the servers they start (gloo groups, `ray start`)."""

from __future__ import annotations

import socket

from benchmarks._ports import _RAY_WORKER_PORTS, _ephemeral_range, free_ports


def test_ports_are_free_distinct_and_outside_the_ranges_other_processes_take_by_themselves() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        # the kernel hands out its ephemeral range to every bind(0) and outgoing connection, and
        # Ray's workers bind in theirs as they start: a number drawn there can be taken first
        assert port not in _ephemeral_range() and port not in _RAY_WORKER_PORTS
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it
