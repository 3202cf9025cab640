"""Clock offset of each agent to rank 0, measured NTP-style at init (collective).

Rank 0 answers ping-pongs from every other agent in turn; for each exchange the
agent knows its send time t0, rank 0's receive time t1 and its own receive time
t2. Rank 0's clock then reads about t1 when this agent's reads (t0 + t2) / 2,
with an error of at most half the round trip t2 - t0, so the exchange with the
smallest round trip wins.
"""
import time

import numpy as np

ROUNDS = 8
_TAG = 0xBF71   # private communicator; a fixed tag keeps the exchange self-describing


def measure_offset(comm, rounds=ROUNDS):
    """(offset_us, rtt_us): add offset_us to a local perf_counter time (µs) to get
    rank 0's perf_counter time of the same instant. Collective over comm."""
    if comm.size == 1:
        return 0.0, 0.0
    if comm.rank == 0:
        _serve(comm, rounds)
        return 0.0, 0.0
    return _ask(comm, rounds)


def _serve(comm, rounds):
    buf = np.zeros(1, dtype=np.int64)
    for peer in range(1, comm.size):
        comm.Send(buf, dest=peer, tag=_TAG)           # "your turn"
        for _ in range(rounds + 1):
            comm.Recv(buf, source=peer, tag=_TAG)
            buf[0] = time.perf_counter_ns()
            comm.Send(buf, dest=peer, tag=_TAG)


def _ask(comm, rounds):
    buf = np.zeros(1, dtype=np.int64)
    # Wait for our turn without spinning: agents share cores, and a spinning
    # waiter would slow down the exchanges being measured.
    req = comm.Irecv(buf, source=0, tag=_TAG)
    while not req.Test():
        time.sleep(0.0005)
    best = None
    for k in range(rounds + 1):    # round 0 warms up the connection
        t0 = time.perf_counter_ns()
        comm.Send(buf, dest=0, tag=_TAG)
        comm.Recv(buf, source=0, tag=_TAG)
        t2 = time.perf_counter_ns()
        rtt = t2 - t0
        if k and (best is None or rtt < best[1]):
            best = (int(buf[0]) - (t0 + t2) / 2, rtt)
    return best[0] / 1000.0, best[1] / 1000.0
