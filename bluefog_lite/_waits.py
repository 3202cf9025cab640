"""What a task (a generator, see _tasks.py) yields to wait: the engine resumes it
once the thing it names has happened. Recv waits for data from peers (resumed when
it arrives); the others are polled every pass of the loop."""
import time


class Recv:
    """Wait until one entry has arrived for each (src, key); resumes with the entries."""
    __slots__ = ("keys",)

    def __init__(self, keys):
        self.keys = keys


class Partial:
    """What a fused group's Recv resumes with when the stall inspector splits the
    group (_stalls.py): the entries of the members whose inputs are all in, by key;
    the task completes those members and waits for the rest."""
    __slots__ = ("taken",)

    def __init__(self, taken):
        self.taken = taken


class Requests:
    """Wait until MPI requests complete (nonblocking collectives)."""
    __slots__ = ("reqs", "what")

    def __init__(self, reqs, what="MPI collective"):
        self.reqs, self.what = reqs, what


class Turn:
    """Wait until every earlier collective has posted its MPI call (MPI needs one order)."""
    __slots__ = ("seq",)

    def __init__(self, seq):
        self.seq = seq


class Until:
    """Resume once ``ready()`` is true (polled with the loop's backoff, like Sleep)."""
    __slots__ = ("ready", "what")

    def __init__(self, ready, what):
        self.ready, self.what = ready, what


class Sleep:
    """Resume after ``seconds`` (a backoff that neither spins nor blocks the loop)."""
    __slots__ = ("until", "what")

    def __init__(self, seconds, what="a backoff"):
        self.until, self.what = time.monotonic() + seconds, what
