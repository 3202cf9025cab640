"""The doorbell that wakes a sleeping communication thread (bluefog_lite/_doorbell.py), in one process."""
import os
import socket
import sys
import threading
import time

import pytest

from bluefog_lite._doorbell import ANYTHING, URGENT_ONLY, Doorbell

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


class BarrierComm(FakeComm):
    """A FakeComm whose agents are threads of this process that meet at Barrier()."""

    def __init__(self, rank, size, token, barrier):
        super().__init__(rank, size, token)
        self.barrier = barrier

    def Barrier(self):
        self.barrier.wait(10)


def pair(hosts=None):
    token = os.urandom(6).hex()
    return [Doorbell(FakeComm(r, 2, token, hosts)) for r in range(2)]


def pair_sharing_flags(size=2):
    """Doorbells created at the same time (as real agents do), so they share their sleep flags."""
    token, barrier = os.urandom(6).hex(), threading.Barrier(size)
    bells = [None] * size

    def make(r):
        bells[r] = Doorbell(BarrierComm(r, size, token, barrier))
    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bells


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
    """The ring is sent (the peer's flag cannot say it is awake) and the failed send
    raises nothing: a peer that has shut down must not take the ringer down."""
    a, b = pair()
    b.close()
    a.ring(1)
    assert a.rings == 1
    a.ring(1)
    assert a.rings == 2
    a.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="sleep flags live in /dev/shm")
def test_an_awake_peer_is_not_rung_a_sleeping_one_is():
    a, b = pair_sharing_flags()
    try:
        assert a.flags is not None and 1 in a._flag_of
        a.ring(1)                          # b has not said it sleeps: no ring, nothing to drain
        assert (a.rings, a.rings_skipped) == (0, 1)
        assert b.wait(0) is False
        b.asleep(1)
        a.ring(1)
        assert a.rings == 1
        assert b.wait(1.0) is True
        b.asleep(0)
        a.ring(1)
        assert (a.rings, a.rings_skipped) == (1, 2)
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="sleep flags live in /dev/shm")
def test_an_idle_peer_is_rung_only_for_urgent_news():
    """URGENT_ONLY (an idle agent): only a large tensor's descriptor rings it; ANYTHING: every packet."""
    a, b = pair_sharing_flags()
    try:
        b.asleep(URGENT_ONLY)
        a.ring(1)
        assert (a.rings, a.rings_skipped) == (0, 1) and b.wait(0) is False
        a.ring(1, urgent=True)
        assert a.rings == 1 and b.wait(1.0) is True
        b.asleep(ANYTHING)
        a.ring(1)
        assert a.rings == 2 and b.wait(1.0) is True
    finally:
        a.close()
        b.close()


def test_a_ring_left_in_the_socket_wakes_the_next_wait():
    """wait(drain=False) leaves the ring for another waiter (the engine's thread leaves a
    caller's ring to the caller); drain() clears it."""
    a, b = pair()
    try:
        a.ring(1)
        assert b.wait(1.0, drain=False) is True
        assert b.wait(0, drain=False) is True      # still there
        b.drain()
        assert b.wait(0) is False
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="sleep flags live in /dev/shm")
def test_the_flag_page_leaves_nothing_in_dev_shm():
    before = {f for f in os.listdir("/dev/shm") if f.startswith("bluefog_lite.")}
    bells = pair_sharing_flags(3)
    try:
        after = {f for f in os.listdir("/dev/shm") if f.startswith("bluefog_lite.")}
        assert after == before
        assert all(sorted(b._flag_of) == sorted(set(range(3)) - {b.rank}) for b in bells)
    finally:
        for b in bells:
            b.close()


def test_bells_that_do_not_share_a_flag_page_always_ring():
    a, b = pair()                          # made one after the other: b maps a page of its own
    try:
        b.asleep(0)
        a.ring(1)
        assert a.rings == 1 and b.wait(1.0) is True
    finally:
        a.close()
        b.close()
