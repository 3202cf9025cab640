"""Doorbells: waking a sleeping communication thread the moment a peer on the
same host has sent it something.

MPI cannot wait for a message without spinning (MPICH's blocking calls poll),
and polling on a timer makes every hop of a small exchange cost up to one
sleep period. So every agent binds one datagram socket in Linux's abstract
namespace; after posting packets for a peer on the same host, the sender
writes one byte to the peer's socket, and an idle communication thread sleeps
in ``select()`` on its own socket. The kernel wakes it at once, and sleeping
costs no CPU. Callers ring their own agent's bell to hand it new operations.

Peers on other hosts, and platforms without abstract sockets, are not rung:
for them the engine keeps its polling timeout (see Engine._sleep).
"""
import secrets
import select
import socket
import sys


class Doorbell:
    """This agent's bell and the addresses of the peers it can ring (collective to create)."""

    def __init__(self, comm):
        token = comm.bcast(secrets.token_hex(8) if comm.rank == 0 else None, root=0)
        self.rank = comm.rank
        self.address = self._address(token, comm.rank)
        self.sock = self._bind(self.address)
        views = comm.allgather((socket.gethostname(), self.sock is not None))
        mine = views[comm.rank]
        self.peers = {r: self._address(token, r) for r, view in enumerate(views)
                      if view == mine and self.sock is not None and r != comm.rank}
        # every rank the bell reaches, so the engine may sleep long while waiting only on them
        self.covers_all = self.sock is not None and len(self.peers) == comm.size - 1
        self.rings = 0
        comm.Barrier()     # every bell bound before anyone rings

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

    def ring(self, rank):
        """Wake rank's communication thread (no-op for a peer this bell cannot reach)."""
        address = self.peers.get(rank)
        if address is None:
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

    def wait(self, timeout):
        """Sleep until rung or timeout seconds pass; clears the rings that arrived."""
        sock = self.sock
        ready, _, _ = select.select((sock,), (), (), timeout)
        if ready:
            try:
                while sock.recv(256):
                    pass
            except OSError:    # BlockingIOError: drained
                pass
        return bool(ready)

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.peers = {}
            self.covers_all = False
