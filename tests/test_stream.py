"""The packet format of _stream.py in one process (no MPI): what a receiver makes
of the packets a sender builds."""
import numpy as np
import torch

from bluefog_lite._pool import BufferPool
from bluefog_lite._stream import _KIND_OBJECT, Outgoing, StreamEndpoint, _header


class _Request:
    def Test(self):
        return True


class RecordingComm:
    """Stands in for the communicator of a sender: keeps what it is asked to send."""

    def __init__(self):
        self.sent = []      # (bytes, dst, tag)

    def Isend(self, buf, dst, tag):
        self.sent.append((bytes(buf[0])[:buf[1]] if len(buf) == 3 else bytes(buf[0]), dst, tag))
        return _Request()


def endpoint(comm=None):
    return StreamEndpoint(comm, 8 << 20, 64 << 10, BufferPool(0))


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


def test_headers_with_objects_are_unpickled_every_time():
    s = endpoint()
    for _ in range(2):
        s._unpack(3, header_only([("neg", _KIND_OBJECT, {"calls": ["a"]}, None)]))
    first, second = s.inbox[(3, "neg")]
    first.value["calls"].append("changed by its receiver")
    assert second.value == {"calls": ["a"]}      # not the same object
    assert s._unpickled == {}


def test_large_tensor_descriptors_repeat_their_header_and_carry_each_tag_in_the_body():
    comm = RecordingComm()
    sender, receiver = endpoint(comm), endpoint()
    big = [torch.arange(1 << 15, dtype=torch.float32) + k for k in range(3)]   # 128 KB each
    small = torch.ones(4)
    for k, x in enumerate(big):
        sender.queue_tensor(5, "s", Outgoing(small * k), [])     # inline, flushed with the descriptor
        sender.queue_tensor(5, "big", Outgoing(x), [])
    packets = [(b, tag) for b, dst, tag in comm.sent if tag == 1]
    data = [(b, tag) for b, dst, tag in comm.sent if tag != 1]
    assert len(packets) == 3 and [tag for _, tag in data] == [2, 3, 4]
    assert all(b == x.numpy().tobytes() for (b, _), x in zip(data, big))
    assert len(sender._packed_headers) == 1          # made once for the three packets
    for b, _ in packets:
        receiver._unpack(5, received(b))
    assert [large.tag for large in receiver.unposted] == [2, 3, 4]
    assert [large.nbytes for large in receiver.unposted] == [1 << 17] * 3
    assert len(receiver._unpickled) == 1             # unpickled once
    assert [float(e.array[0]) for e in receiver.inbox[(5, "s")]] == [0.0, 1.0, 2.0]
