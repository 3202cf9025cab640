"""Doorbells: waking a sleeping communication thread the moment a peer on the
same host has sent it something.

MPI cannot wait for a message without spinning (MPICH's blocking calls poll),
and polling on a timer makes every hop of a small exchange cost up to one
sleep period. So every agent binds one datagram socket in Linux's abstract
namespace; after posting packets for a peer on the same host, the sender
writes one byte to the peer's socket, and an idle communication thread sleeps
in ``select()`` (``poll()`` for a descriptor >= 1024) on its own socket. The
kernel wakes it at once, and sleeping costs no CPU. Callers ring their own
agent's bell to hand it new operations.

A ring is a system call for the sender and a spurious wake-up for a thread that
is not asleep, so agents on the same host also share a page of *sleep flags*
(a file in /dev/shm, unlinked as soon as every agent has mapped it): a thread
sets its flag just before it sleeps, and a peer rings only while the flag is
set. A thread that sets its flag looks for work once more before it sleeps
(Engine._sleep), so a peer that found the flag clear has already left
something that look finds (it probes twice: one MPICH probe may only move a
waiting message into MPI's queue); the engine's timed MPI poke is the safety net.
The flag has two levels: ANYTHING (an agent with operations in flight wants
to hear of every packet) and URGENT_ONLY (an idle agent wants to hear only of
a large tensor's descriptor, whose sender waits until the receive is posted;
other data can wait in MPI until the agent starts the operation it is for).

Peers on other hosts, and platforms without abstract sockets, are not rung:
for them the engine keeps its polling timeout (see Engine._sleep).
"""
import math
import mmap
import os
import secrets
import select
import socket
import sys

_LINE = 64     # one cache line per agent: a flag written often does not slow its neighbors' reads
ANYTHING, URGENT_ONLY = 1, 2     # sleep flag levels (0: awake, do not ring)


def _marker(token, rank):
    """What agent rank writes after its flag: a peer that reads it back shares the page."""
    return f"{token}:{rank}".encode().ljust(_LINE - 1, b"\0")[:_LINE - 1]


class Doorbell:
    """This agent's bell and the addresses of the peers it can ring (collective to create)."""

    def __init__(self, comm):
        token = comm.bcast(secrets.token_hex(8) if comm.rank == 0 else None, root=0)
        self.rank = comm.rank
        self.address = self._address(token, comm.rank)
        self.sock = self._bind(self.address)
        self._fd = self.sock.fileno() if self.sock is not None else -1
        views = comm.allgather((socket.gethostname(), self.sock is not None))
        mine = views[comm.rank]
        self.peers = {r: self._address(token, r) for r, view in enumerate(views)
                      if view == mine and self.sock is not None and r != comm.rank}
        # every rank the bell reaches, so the engine may sleep long while waiting only on them
        self.covers_all = self.sock is not None and len(self.peers) == comm.size - 1
        self.rings = self.rings_skipped = 0
        path = f"/dev/shm/bluefog_lite.{token}.{mine[0].replace('/', '_')}"
        flags = self._map_flags(path, comm.size) if self.peers else None
        if flags is not None:
            flags[comm.rank * _LINE + 1:(comm.rank + 1) * _LINE] = _marker(token, comm.rank)
        comm.Barrier()     # every bell bound (and every flag page mapped and marked) before anyone rings
        self.flags, self._flag_at, self._flag_of = flags, comm.rank * _LINE, {}
        if flags is not None:
            try:
                os.unlink(path)          # every local agent has it mapped: nothing is left behind
            except OSError:
                pass
            # a peer whose marker is missing maps another page (another /dev/shm): always ring it
            self._flag_of = {r: r * _LINE for r in self.peers
                             if flags[r * _LINE + 1:(r + 1) * _LINE] == _marker(token, r)}

    @staticmethod
    def _map_flags(path, size):
        """The shared page of sleep flags, or None where it cannot be had (no
        /dev/shm): then every ring is sent."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return None
        try:
            os.ftruncate(fd, size * _LINE)    # every agent sets the same size: creation order does not matter
            return mmap.mmap(fd, size * _LINE)
        except OSError:
            return None
        finally:
            os.close(fd)

    @staticmethod
    def _address(token, rank):
        return f"\0bluefog_lite.{token}.{rank}"

    @staticmethod
    def _bind(address):
        if not sys.platform.startswith("linux"):
            return None      # abstract socket names are Linux-only
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return None
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        return sock

    def asleep(self, flag):
        """Tell the peers that this agent sleeps and what to ring it for (ANYTHING,
        URGENT_ONLY), or that it is awake (0)."""
        if self.flags is not None:
            self.flags[self._flag_at] = flag

    def ring(self, rank, urgent=False):
        """Wake rank if it sleeps and asked to hear of this (urgent: a large tensor's
        descriptor); no-op for a peer this bell cannot reach."""
        address = self.peers.get(rank)
        if address is None:
            return
        at = self._flag_of.get(rank)
        if at is not None:
            flag = self.flags[at]
            if not flag or (flag == URGENT_ONLY and not urgent):
                self.rings_skipped += 1      # awake (it looks for work before it sleeps), or idle
                return
        self.rings += 1
        try:
            self.sock.sendto(b"!", address)
        except OSError:
            pass     # its buffer is full (it will wake anyway) or it has shut down

    def wake_self(self):
        if self.sock is not None:
            try:
                self.sock.sendto(b"!", self.address)   # getsockname() costs ~10 us
            except OSError:
                pass

    def wait(self, timeout, drain=True):
        """Sleep until rung or timeout seconds pass; True if rung. Clears the rings
        that arrived unless drain is False (then call drain())."""
        if self._fd < 1024:         # (select() sleeps in microseconds, poll() in whole milliseconds)
            ready = select.select((self.sock,), (), (), timeout)[0]
        else:   # select() refuses descriptors >= 1024 (a process with many files open)
            waiting = select.poll()         # (one per call: callers on two threads may wait)
            waiting.register(self._fd, select.POLLIN)
            ready = waiting.poll(None if timeout is None else math.ceil(max(0.0, timeout) * 1000.0))
        if ready and drain:
            self.drain()
        return bool(ready)

    def drain(self):
        try:
            while self.sock.recv(256):
                pass
        except OSError:    # BlockingIOError: drained
            pass

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.peers = {}
            self.covers_all = False
        if self.flags is not None:
            self.flags.close()
            self.flags, self._flag_of = None, {}
