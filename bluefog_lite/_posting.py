"""When the data of a large tensor is received: the memory policy of the loop.

A large tensor comes as a descriptor packet; its data stays in the sender's
memory until the receiver posts the receive into a pooled buffer (_stream.py).
post_receives() decides when: data an active operation waits for at once, data
of an operation this agent has not started yet (a neighbor running ahead) only
when it is the next of its name from that neighbor and a buffer is free that the
active operations will not need. So an agent holds receive buffers for the
operations it runs, not for everything its neighbors send.
"""


def post_receives(stream, waiters, discard):
    """Post the receives of the descriptors in stream.unposted that may be posted now
    (see the module's docstring); the rest stay. waiters: (src, key) -> the operation
    waiting for it; discard: the (src, key)s of timed-out operations' late inputs
    (dropped on arrival). True if any was posted."""
    ahead = []
    for large in stream.unposted:
        if _awaited(stream.inbox, large, waiters, discard):
            stream.post(large)
        else:
            ahead.append(large)
    held = []
    if ahead:
        inbox, free = stream.inbox, stream.pool.free_count
        unannounced = sum(1 for k in waiters if not inbox.get(k))   # buffers still owed
        for large in ahead:
            if free(large.nbytes) > unannounced and next_of_its_keys(inbox, large):
                stream.post(large)
            else:
                held.append(large)
    posted = len(held) < len(stream.unposted)
    stream.unposted = held
    return posted


def next_of_its_keys(inbox, large):
    """True if this receive is the oldest entry under each of its keys: the data of
    the next operation of that name from that neighbor. One queued behind it is two
    or more operations ahead and stays with the sender, so running ahead never makes
    an agent hold more than one round of a name per neighbor."""
    return all(_oldest_under(inbox, k, large.item) for k in large.keys)


def _awaited(inbox, large, waiters, discard):
    """True if this receive holds the first entry under one of its keys and an
    active operation waits for that key (or it is the leftover of a timed-out one).
    A waiting operation keeps its keys until all its data is in, so an entry queued
    behind one it already has is a later operation's."""
    return any((k in waiters or k in discard) and _oldest_under(inbox, k, large.item) for k in large.keys)


def _oldest_under(inbox, key, item):
    """True if item (an Entry, or the Slab of a Member) is the first entry queued under key."""
    q = inbox.get(key)
    return bool(q) and (q[0] is item or getattr(q[0], "slab", None) is item)
