"""The doorbell that wakes a sleeping communication thread (bluefog_lite/_doorbell.py), in one process."""
import os
import socket
import sys
import time

import pytest

from bluefog_lite._doorbell import Doorbell

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")


class FakeComm:
    """Just enough of an MPI communicator for Doorbell: rank r of a job whose
    agents report the given (host, bound) views."""

    def __init__(self, rank, size, token, hosts=None):
        self.rank, self.size, self.token = rank, size, token
        self.hosts = hosts or [socket.gethostname()] * size

    def bcast(self, obj, root=0):
        return self.token

    def allgather(self, mine):
        return [mine if r == self.rank else (h, True) for r, h in enumerate(self.hosts)]

    def Barrier(self):
        pass


def pair(hosts=None):
    token = os.urandom(6).hex()
    return [Doorbell(FakeComm(r, 2, token, hosts)) for r in range(2)]


def test_a_ring_wakes_the_peer_and_is_consumed():
    a, b = pair()
    try:
        assert a.covers_all and b.covers_all
        assert b.wait(0) is False
        a.ring(1)
        t = time.monotonic()
        assert b.wait(5.0) is True
        assert time.monotonic() - t < 1.0
        assert b.wait(0) is False          # the ring was drained
        assert a.rings == 1
    finally:
        a.close()
        b.close()


def test_wait_times_out_without_a_ring():
    a, b = pair()
    try:
        t = time.monotonic()
        assert b.wait(0.05) is False
        assert time.monotonic() - t >= 0.045
    finally:
        a.close()
        b.close()


def test_many_rings_wake_once_each_wait_and_wake_self():
    a, b = pair()
    try:
        for _ in range(1000):              # more than the socket buffer holds: never blocks or raises
            a.ring(1)
        assert b.wait(1.0) is True
        assert b.wait(0) is False
        b.wake_self()
        assert b.wait(1.0) is True
    finally:
        a.close()
        b.close()


def test_peers_on_other_hosts_are_not_rung_and_do_not_count_as_covered():
    token = os.urandom(6).hex()
    hosts = [socket.gethostname(), "another-host"]
    a = Doorbell(FakeComm(0, 2, token, hosts))
    try:
        assert a.peers == {} and not a.covers_all
        a.ring(1)                          # no-op, no error
        assert a.rings == 0
    finally:
        a.close()


def test_ringing_a_closed_peer_is_harmless():
    a, b = pair()
    b.close()
    a.ring(1)
    a.close()
