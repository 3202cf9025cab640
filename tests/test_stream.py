"""The packet format of _stream.py in one process (no MPI): what a receiver makes
of the packets a sender builds."""
import numpy as np
import torch

from bluefog_lite._mpi import MPI
from bluefog_lite._pool import BufferPool
from bluefog_lite._stream import _KIND_OBJECT, Outgoing, StreamEndpoint, _header


class _Request:
    def Test(self):
        return True


class RecordingComm:
    """Stands in for the communicator of a sender: keeps what it is asked to send."""

    def __init__(self, tag_ub=(1 << 29) - 1):
        self.sent = []      # (bytes, dst, tag)
        self.tag_ub = tag_ub

    def Get_attr(self, key):
        assert key == MPI.TAG_UB
        return self.tag_ub

    def Isend(self, buf, dst, tag):
        self.sent.append((bytes(buf[0])[:buf[1]] if len(buf) == 3 else bytes(buf[0]), dst, tag))
        return _Request()


def endpoint(comm=None):
    return StreamEndpoint(comm or RecordingComm(), 8 << 20, 64 << 10, BufferPool(0))


def test_data_tags_stay_within_the_mpis_tag_bound():
    """The MPI standard only promises tags up to 32767 (MPI_TAG_UB); private data tags
    cycle below whatever bound the MPI gives."""
    ep = endpoint(RecordingComm(tag_ub=100))
    tags = [ep._data_tag(3) for _ in range(300)]
    assert min(tags) == 2 and max(tags) == 100 and tags[:3] == [2, 3, 4] and tags[99] == 2


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


class _Status:
    def __init__(self):
        self.source = self.count = None

    def Get_source(self):
        return self.source

    def Get_count(self, datatype):
        return self.count


class _Message:
    def __init__(self, data):
        self.data = data

    def Recv(self, buf):
        buf[0][:] = np.frombuffer(self.data, np.uint8)


class InboundComm(RecordingComm):
    """Stands in for the communicator of a receiver: hands out queued packets."""

    def __init__(self, packets):
        super().__init__()
        self.packets = list(packets)      # (src, bytes), in arrival order

    def Improbe(self, source, tag, status):
        if not self.packets:
            return None
        status.source, data = self.packets.pop(0)
        status.count = len(data)
        return _Message(data)


def test_receive_small_takes_the_expected_packets_and_files_everything_else():
    maker = endpoint()
    meta = ("float32", (4,))
    x = {src: np.arange(4, dtype=np.float32) + 10 * src for src in range(1, 5)}
    packets = [
        (3, maker.small_packet("v", meta, x[3])),                 # another name
        (1, maker.small_packet("w", meta, x[1])),                 # expected
        (1, maker.small_packet("w", meta, x[1] * 2)),             # rank 1's next round
        (4, maker.small_packet("w", ("float32", (2,)), x[4][:2])),  # not from a wanted rank
    ]
    s = endpoint(InboundComm(packets))
    head = s.small_head("w", meta, 16)
    wanted, found = {1, 2}, []
    assert s.receive_small(_Status(), "w", head, s.small_size(head, 16), wanted, found)
    assert wanted == {2} and [src for src, _ in found] == [1]
    assert np.array_equal(np.ndarray((4,), np.float32, found[0][1], len(head)), x[1])
    assert [float(e.array[0]) for e in s.inbox[(1, "w")]] == [20.0]     # filed: rank 1 was no longer wanted
    assert (3, "v") in s.inbox and (4, "w") in s.inbox
    s.put_back(found, "w")      # the call goes the general way: first things first
    assert [float(e.array[0]) for e in s.inbox[(1, "w")]] == [10.0, 20.0]


def test_receive_small_says_when_a_wanted_rank_sent_something_else_under_the_name():
    maker = endpoint()
    meta = ("float32", (4,))
    packets = [(2, maker.small_packet("w", ("float32", (5,)), np.ones(5, np.float32))),
               (1, maker.small_packet("w", meta, np.ones(4, np.float32)))]
    s = endpoint(InboundComm(packets))
    head = s.small_head("w", meta, 16)
    wanted, found = {1, 2}, []
    assert not s.receive_small(_Status(), "w", head, s.small_size(head, 16), wanted, found)
    assert wanted == {2} and [src for src, _ in found] == [1]
    assert s.inbox[(2, "w")][0].meta == ("float32", (5,))    # for the general path's message


class PostingComm(InboundComm):
    """InboundComm that also records the receives posted: (buffer, nbytes, src, tag)."""

    def __init__(self, packets):
        super().__init__(packets)
        self.posted = []

    def Irecv(self, buf, src, tag):
        self.posted.append((buf[0], buf[1], src, tag))
        return _Request()


def descriptors(sends):
    """The descriptor packets of large tensors: sends is [(src, name, tensor)], in the
    order the packets arrive; each src sends with its own data tags (2, 3, ...)."""
    makers, packets = {}, []
    for src, name, t in sends:
        comm = RecordingComm()
        maker = makers.setdefault(src, endpoint(comm))
        maker.comm = comm
        raw = t.numpy().view(np.uint8).reshape(-1)
        maker.send_large(0, maker.large_head(name, ("float32", tuple(t.shape)), raw.nbytes), raw, t, [])
        packets.append((src, comm.sent[0][0]))      # (the descriptor: the data message follows it)
    return packets


def test_receive_large_posts_the_expected_descriptors_data_and_files_everything_else():
    x = torch.ones(1 << 15)      # 128 KB
    packets = descriptors([(3, "v", x), (1, "w", x), (1, "w", x), (4, "w", x[:10]), (2, "w", x)])
    comm = PostingComm(packets)
    s = StreamEndpoint(comm, 8 << 20, 64 << 10, BufferPool(1 << 20))
    meta = ("float32", (1 << 15,))
    head = s.large_head("w", meta, 1 << 17)
    wanted, found = {1, 2, 5}, []
    assert s.receive_large(_Status(), "w", head, 1 << 17, wanted, found)
    assert wanted == {5} and [f[0] for f in found] == [1, 2]
    # each one's data posted at once into its own buffer, on the tag its descriptor names
    assert [(n, src, tag) for _, n, src, tag in comm.posted] == [(1 << 17, 1, 2), (1 << 17, 2, 2)]
    assert [f[2] for f in found] == [p[0] for p in comm.posted]
    # filed as receive() files them: rank 1's next round, another name, a rank not wanted
    assert [(large.keys, large.tag) for large in s.unposted] == [([(3, "v")], 2), ([(1, "w")], 3), ([(4, "w")], 2)]
    assert len(s.inbox[(1, "w")]) == 1 and (2, "w") not in s.inbox
    s.put_back_large(found, "w", meta)     # the call goes the general way: its receives stay posted
    first = s.inbox[(1, "w")][0]
    assert first.meta == meta and first.value.shape == (1 << 15,) and not first.ready
    assert first.value.numpy().base is not None and np.shares_memory(first.value.numpy(), found[0][2])
    assert s.unposted[1].item is s.inbox[(1, "w")][1]      # the next round stays behind it
    assert [e for _, e in s.pending_recvs] == [first, s.inbox[(2, "w")][0]]
    assert s.test_recvs() and first.ready and s.to_ring == {1, 2}


def test_receive_large_says_when_a_wanted_rank_sent_something_else_under_the_name():
    x = torch.ones(1 << 15)
    comm = PostingComm(descriptors([(2, "w", x[:20000]), (1, "w", x)]))
    s = StreamEndpoint(comm, 8 << 20, 64 << 10, BufferPool(1 << 20))
    head = s.large_head("w", ("float32", (1 << 15,)), 1 << 17)
    wanted, found = {1, 2}, []
    assert not s.receive_large(_Status(), "w", head, 1 << 17, wanted, found)
    assert wanted == {2} and [f[0] for f in found] == [1]
    assert s.inbox[(2, "w")][0].meta == ("float32", (20000,))    # for the general path's message
    assert [large.keys for large in s.unposted] == [[(2, "w")]] and len(comm.posted) == 1
