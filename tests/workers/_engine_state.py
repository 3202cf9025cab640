"""The engine's state as the worker scripts wait for it (imported from their own folder)."""
import time


def thread_asleep(eng, limit_s=2.0):
    """Wait (bounded) until the communication thread of engine eng sleeps: the condition
    under which a blocking call is run by its caller. On a loaded host the thread, woken
    by a peer or handed work back by a caller, may still be on its way back to sleep when
    the next call comes; then it runs that call."""
    end = time.monotonic() + limit_s
    while not (eng._sleeping and not eng._drive.locked()) and time.monotonic() < end:
        time.sleep(0.001)
