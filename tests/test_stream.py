"""The packet format of _stream.py in one process (no MPI): what a receiver makes
of the packets a sender builds."""
import numpy as np

from bluefog_lite._pool import BufferPool
from bluefog_lite._stream import _KIND_OBJECT, _KIND_TENSOR, StreamEndpoint, _header


def endpoint():
    return StreamEndpoint(None, 8 << 20, 64 << 10, BufferPool(0))


def received(data):
    """A packet as the receiver holds it: a uint8 array."""
    return np.frombuffer(bytes(data), np.uint8)


def header_only(entries):
    return received(b"".join(_header(entries)))


def test_repeated_headers_are_unpickled_once_and_each_packet_keeps_its_own_data():
    s = endpoint()
    sent = [np.arange(4, dtype=np.float32) + 10 * k for k in range(3)]
    for x in sent:
        s._unpack(1, received(s.small_packet("w", ("float32", (4,)), x)))
    s._unpack(2, received(s.small_packet("w", ("float32", (4,)), sent[0] * -1)))
    got = [e.array for e in s.inbox[(1, "w")]]
    assert len(got) == 3 and all(np.array_equal(g, x) for g, x in zip(got, sent))
    assert np.array_equal(s.inbox[(2, "w")][0].array, -sent[0])
    assert [e.src for e in s.inbox[(2, "w")]] == [2]
    assert len(s._unpickled) == 1        # one header, four packets


def test_headers_with_objects_or_large_tensors_are_unpickled_every_time():
    s = endpoint()
    for _ in range(2):
        s._unpack(3, header_only([("neg", _KIND_OBJECT, {"calls": ["a"]}, None)]))
    first, second = s.inbox[(3, "neg")]
    first.value["calls"].append("changed by its receiver")
    assert second.value == {"calls": ["a"]}      # not the same object
    s._unpack(3, header_only([("big", _KIND_TENSOR, ("float32", (1 << 18,)), ("t", 7, 1 << 20))]))
    assert len(s.unposted) == 1 and s.unposted[0].tag == 7
    assert s._unpickled == {}
