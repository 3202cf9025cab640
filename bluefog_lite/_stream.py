"""The per-neighbor message stream: packing many small tensors into one MPI message
(tensor fusion), self-describing packets, and the inbox that matches what arrived to
the operations that wait for it.

Every piece of data one agent sends another travels as an *entry* of a packet on
STREAM_TAG: ``(key, meta, loc)`` where ``key`` names the operation (its name, or a
collective sequence number), ``meta`` is ``(dtype, shape)`` for a tensor or the
object itself, and ``loc`` says where the bytes are: inline in the packet, or in a
separate message on a private tag (large tensors, sent straight from the user's
memory with no copy). MPI keeps messages between two agents on one tag in order,
so entries of one key arrive in the order they were sent; an entry that arrives
before the local operation asks for it waits in the inbox.
"""
import collections
import itertools
import pickle
import struct

import numpy as np
import torch

from ._mpi import MPI

STREAM_TAG = 1
_FIRST_DATA_TAG = 2
_DATA_TAGS = 1 << 20          # private tags cycle through [2, 2 + 2^20), or fewer (StreamEndpoint)
_ALIGN = 64
_HEAD = struct.Struct("<Q")

_KIND_TENSOR, _KIND_OBJECT, _KIND_GROUP = 0, 1, 2
# The tensors of these operations carry the operation's kind as their header kind
# (neighbor_allreduce's, the bulk of the traffic, are plain _KIND_TENSOR): a neighbor
# running another operation under the same name can tell, and fail instead of
# combining them.
MARKED_KINDS = ("NEIGHBOR_ALLGATHER", "PAIR_GOSSIP")
_ANY_SOURCE = MPI.ANY_SOURCE
_BYTE = MPI.BYTE


def _aligned(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _inline_entry(key, kind, meta, offset, nbytes):
    """A header entry whose bytes are in the packet, ``offset`` bytes after the header."""
    return (key, kind, meta, ("i", offset, nbytes))


def _header(entries):
    """The pieces of a packet before its inline bytes: the header's length, the
    pickled entries, padding to _ALIGN."""
    header = pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)
    used = _HEAD.size + len(header)
    return _HEAD.pack(len(header)), header, _PADDING[_aligned(used) - used]


_CACHED = 1024      # entries of each header cache: generated names must not grow one without bound


def _remember(cache, key, value):
    """cache[key] = value, emptying the cache first once it holds _CACHED entries.
    Returns value."""
    if len(cache) >= _CACHED:
        cache.clear()
    cache[key] = value
    return value


_EMPTY = np.empty(0, np.uint8)
_PADDING = [bytes(n) for n in range(_ALIGN)]
_TAG = struct.Struct("<Q")     # a large entry's private tag, in the packet's body


def _tag_piece(tag):
    """The body piece of a large entry: its tag, padded to _ALIGN."""
    return _TAG.pack(tag) + _PADDING[_ALIGN - _TAG.size]



def plain(t):
    """t, detached, with its values in its own contiguous memory: a lazily negated or
    conjugated view (the neg/conj bit, e.g. ``z.conj().imag``) is resolved, as its
    bytes are not its values, and a non-contiguous tensor is copied. No copy otherwise."""
    if t.requires_grad:
        t = t.detach()
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    return t if t.is_contiguous() else t.contiguous()


def copy_into(target, value):
    """target.copy_(value), also into a target with the neg bit (z.conj().imag of a
    complex32 z): torch ignores the bit when copy_ casts into it, so a value of
    another dtype is cast first."""
    target.copy_(value.to(target.dtype) if target.is_neg() else value)


def tensor_bytes(t):
    """A flat uint8 numpy view of a contiguous CPU tensor (no copy)."""
    if not t.numel():
        return _EMPTY
    try:
        return t.numpy().reshape(-1).view(np.uint8)     # half the cost of the torch route
    except (TypeError, RuntimeError):     # no numpy dtype (bfloat16), needs grad, conjugate bit
        flat = t.detach().reshape(-1)
        if flat.stride(0) != 1:     # one element: torch calls it contiguous whatever its stride
            flat = flat.as_strided((1,), (1,))
        return flat.view(torch.uint8).numpy()


_dtype_names = {}      # torch dtype -> "float32"
_dtypes = {}           # "float32" -> (torch dtype, numpy dtype or None)


def dtype_name(dtype):
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).replace("torch.", "")
    return name


def _dtypes_of(name):
    found = _dtypes.get(name)
    if found is None:
        tdt = getattr(torch, name)
        try:
            npdt = torch.empty(0, dtype=tdt).numpy().dtype
        except TypeError:
            npdt = None
        found = _dtypes[name] = (tdt, npdt)
    return found


class Outgoing:
    """A tensor described once for every destination it goes to: its kind, meta
    (dtype, shape) or (dtype, members), bytes and size."""
    __slots__ = ("kind", "meta", "raw", "nbytes", "tensor")

    def __init__(self, t, members=None, sent_by=None):
        name = dtype_name(t.dtype)
        if members is None:
            self.kind = _KIND_TENSOR if sent_by is None else sent_by    # (see MARKED_KINDS)
            self.meta = (name, tuple(t.shape))
        else:
            self.kind, self.meta = _KIND_GROUP, (name, members)
        self.raw = tensor_bytes(t)
        self.nbytes = self.raw.nbytes
        self.tensor = t


class Entry:
    """One received item. ``value`` is a tensor (a view into the packet or a
    private buffer) or an object; ``ready`` turns True when its bytes are in.
    A small tensor with a numpy dtype arrives as ``array``, a numpy view into the
    packet, and becomes a tensor when ``value`` is first read (_quick.py computes
    with the array and never makes one)."""
    __slots__ = ("src", "key", "meta", "is_tensor", "sent_by", "array", "_value", "ready", "_release")

    def __init__(self, src, key, meta, is_tensor, sent_by=None):
        self.src, self.key, self.meta, self.is_tensor = src, key, meta, is_tensor
        self.sent_by = sent_by         # the sender's operation, if one of MARKED_KINDS
        self.array = self._value = None
        self.ready, self._release = False, None

    @property
    def value(self):
        v = self._value
        if v is None and self.array is not None:
            v = self._value = torch.from_numpy(self.array)
        return v

    @value.setter
    def value(self, v):
        self._value = v

    def describe(self):
        if not self.is_tensor:
            return "object"
        dtype, shape = self.meta
        return f"{dtype}{list(shape)}"

    def release(self):
        if self._release is not None:
            self._release()
            self._release = None
        self._value = self.array = None


class Slab:
    """The bytes of a fused group: the flat tensors of several operations, back to
    back, sent as one entry. Each member becomes a Member entry in the inbox under
    its operation's name; the slab is released when all of its members are."""
    __slots__ = ("src", "dtype", "names", "shapes", "offsets", "flat", "ready", "_release", "_left")

    def __init__(self, src, dtype, members):
        self.src, self.dtype = src, dtype
        self.names = [m[0] for m in members]
        self.shapes = [m[1] for m in members]
        self.offsets = [0]
        for m in members:
            self.offsets.append(self.offsets[-1] + m[2])
        self.flat, self.ready, self._release, self._left = None, False, None, len(members)

    def keys(self):
        return [(self.src, name) for name in self.names]

    def region(self, first, count):
        """The flat tensor of members first .. first+count-1 (a view, no copy)."""
        return self.flat[self.offsets[first]:self.offsets[first + count]]

    def release_one(self):
        self._left -= 1
        if self._left == 0:
            if self._release is not None:
                self._release()
                self._release = None
            self.flat = None


class Member:
    """One operation's part of a Slab; behaves as an Entry."""
    __slots__ = ("slab", "index", "released")
    is_tensor = True
    sent_by = None     # fused groups are neighbor_allreduce's
    array = None       # (see Entry) its value is always a tensor, a view of the slab

    def __init__(self, slab, index):
        self.slab, self.index, self.released = slab, index, False

    src = property(lambda self: self.slab.src)
    key = property(lambda self: self.slab.names[self.index])
    meta = property(lambda self: (self.slab.dtype, self.slab.shapes[self.index]))
    ready = property(lambda self: self.slab.ready)

    @property
    def value(self):
        return self.slab.region(self.index, 1).view(self.slab.shapes[self.index])

    def describe(self):
        return f"{self.slab.dtype}{list(self.slab.shapes[self.index])}"

    def release(self):
        if not self.released:
            self.released = True
            self.slab.release_one()


def _as_tensor(raw, meta):
    dtype, shape = meta
    tdt, npdt = _dtypes_of(dtype)
    if raw.size == 0:
        return torch.empty(shape, dtype=tdt)
    if npdt is not None:
        return torch.from_numpy(np.ndarray(shape, npdt, raw))   # ~half the cost of torch views
    return torch.from_numpy(raw).view(tdt).reshape(shape)


class LargeReceive:
    """A large tensor (or fused group) whose descriptor has arrived: its bytes wait
    in the sender's memory until the engine posts the receive (_posting.py)."""
    __slots__ = ("item", "tag", "nbytes", "keys")

    def __init__(self, item, tag, nbytes, keys):
        self.item, self.tag, self.nbytes, self.keys = item, tag, nbytes, keys


class Outbox:
    """What one agent will send to one destination in the next flush: the entries
    and the pieces of the packet's body (inline bytes, each padded to _ALIGN)."""
    __slots__ = ("entries", "inline_bytes", "pieces")

    def __init__(self):
        self.entries, self.pieces, self.inline_bytes = [], [], 0


class StreamEndpoint:
    """Packs outgoing entries per destination and unpacks incoming packets.

    Used only from the communication thread."""

    def __init__(self, comm, fusion_threshold, inline_limit, pool):
        self.comm = comm
        # an MPI may allow tags only up to 32767 (the standard's least MPI_TAG_UB)
        bound = comm.Get_attr(MPI.TAG_UB)      # (None where an MPI does not say)
        self._data_tags = _DATA_TAGS if bound is None else min(_DATA_TAGS, bound - _FIRST_DATA_TAG + 1)
        self.fusion_threshold = fusion_threshold
        self.inline_limit = inline_limit
        self.pool = pool
        self.outboxes = {}
        self.inbox = collections.defaultdict(collections.deque)   # (src, key) -> deque[Entry]
        self._next_tag = collections.defaultdict(int)
        self.pending_recvs = []   # (request, entry)
        self.unposted = []        # LargeReceive: announced data the engine has not asked for yet
        self.sent_packets = []    # (request, packet) kept alive until sent
        self.failed_sends = []    # (request, what it keeps alive): sends and calls of failed ops (Engine.keep_sending)
        self.arrived = []         # (src, key) of entries that became ready
        self.to_ring = set()      # peers sent something since the last ring (see _doorbell.py)
        self.urgent = set()       # ... among them, a large tensor's descriptor (rung even when idle)
        self.stats = collections.Counter()   # packets, entries, data_messages (for tests/benchmarks)
        self._headers = {}        # (key, meta) -> packet header of one small tensor (small_packet)
        self._packed_headers = {}  # entries -> their packet header (_packed)
        self._unpickled = {}      # pickled header -> its entries (_entries_of)

    # ---- sending -------------------------------------------------------
    def queue_tensor(self, dst, key, out, data_requests):
        """Queue Outgoing ``out`` for ``dst``. Large tensors get their own message
        (its request is appended to ``data_requests``); small ones go inline. For a
        fused group (out.kind _KIND_GROUP) the receiver files each member under its
        own name (``key`` unused)."""
        box = self.outboxes.get(dst)
        if box is None:
            box = self.outboxes[dst] = Outbox()
        nbytes = out.nbytes
        if nbytes <= self.inline_limit:
            if box.inline_bytes + nbytes > self.fusion_threshold and box.entries:
                self.flush_one(dst)
                box = self.outboxes[dst] = Outbox()
            box.entries.append(_inline_entry(key, out.kind, out.meta, box.inline_bytes, nbytes))
            padded = _aligned(nbytes)
            box.pieces.append(out.raw)
            if padded != nbytes:
                box.pieces.append(_PADDING[padded - nbytes])
            box.inline_bytes += padded
            return
        tag = self._data_tag(dst)
        # the tag goes in the body, so that the header repeats from call to call (_packed)
        box.entries.append((key, out.kind, out.meta, ("t", box.inline_bytes, nbytes)))
        box.pieces.append(_tag_piece(tag))
        box.inline_bytes += _ALIGN
        # The descriptor must be posted before the data so the receiver learns the tag.
        self.flush_one(dst)
        self._send_data(dst, tag, out.raw, out.tensor, data_requests)

    def send_large(self, dst, head, raw, tensor, data_requests):
        """A large tensor (its descriptor's header ``head``, from large_head; bytes
        ``raw``, any buffer MPI takes) to dst as queue_tensor and flush_one send it:
        what is queued for dst, its descriptor packet, then its data (request
        appended to data_requests)."""
        if dst in self.outboxes:     # what was queued before goes first
            self.flush_one(dst)
        tag = self._data_tag(dst)
        self.send_packet(dst, head + _tag_piece(tag))
        self.to_ring.add(dst)
        self._send_data(dst, tag, raw, tensor, data_requests)

    def large_head(self, key, meta, nbytes):
        """The header of the descriptor packet of one large tensor under key (dtype and
        shape ``meta``, ``nbytes`` bytes), as send_large sends it before the data's tag."""
        entries = ((key, _KIND_TENSOR, meta, ("t", 0, nbytes)),)
        head = self._packed_headers.get(entries)
        if head is None:
            head = self._packed(list(entries))     # (the header pickles a list, as flush_one's)
        return head

    def _data_tag(self, dst):
        """The next private tag of a large message to dst."""
        n = self._next_tag[dst]
        self._next_tag[dst] = n + 1
        return _FIRST_DATA_TAG + n % self._data_tags

    def _send_data(self, dst, tag, raw, tensor, data_requests):
        """The data message of a large entry whose descriptor is sent; tensor is kept
        alive with its request until MPI has read it, beside dst (who has not taken it:
        Engine.waiting_for_data)."""
        self.urgent.add(dst)
        self.stats["data_messages"] += 1
        data_requests.append((self.comm.Isend([raw, raw.nbytes, MPI.BYTE], dst, tag), (tensor, dst)))

    def queue_object(self, dst, key, obj):
        box = self.outboxes.get(dst)
        if box is None:
            box = self.outboxes[dst] = Outbox()
        box.entries.append((key, _KIND_OBJECT, obj, None))

    def flush_one(self, dst):
        """Send dst's pending entries as one packet; returns its request."""
        box = self.outboxes.pop(dst, None)
        if box is None or not box.entries:
            return None
        # one join copies the header and every inline payload (padded) into the packet
        packet = b"".join([self._packed(box.entries), *box.pieces])
        req = self.send_packet(dst, packet, len(box.entries))
        self.to_ring.add(dst)
        return req

    def _packed(self, entries):
        """The packet header of these entries (_header, joined). A loop sends the same
        entries again and again, so the headers of tensors (not of objects or fused
        groups, whose meta is not hashable or seldom repeats) are made once."""
        if any(e[1] == _KIND_OBJECT or e[1] == _KIND_GROUP for e in entries):
            return b"".join(_header(entries))
        key = tuple(entries)
        head = self._packed_headers.get(key)
        if head is None:
            head = _remember(self._packed_headers, key, b"".join(_header(entries)))
        return head

    def send_packet(self, dst, packet, entries=1):
        req = self.comm.Isend([packet, _BYTE], dst, STREAM_TAG)
        self.stats["packets"] += 1
        self.stats["entries"] += entries
        self.sent_packets.append((req, packet))
        return req

    def small_head(self, key, meta, nbytes):
        """The header of the packet of one small tensor (dtype and shape ``meta``,
        ``nbytes`` bytes) under key, as flush_one would build it; each (key, meta)'s
        is made once."""
        head = self._headers.get((key, meta))
        if head is None:
            head = _remember(self._headers, (key, meta),
                             b"".join(_header([_inline_entry(key, _KIND_TENSOR, meta, 0, nbytes)])))
        return head

    def small_packet(self, key, meta, raw):
        """The packet of one small tensor (see small_head), bytes ``raw``."""
        n = raw.nbytes
        return b"".join((self.small_head(key, meta, n), raw, _PADDING[_aligned(n) - n]))

    @staticmethod
    def small_size(head, nbytes):
        """The length of a small packet with this header and payload."""
        return len(head) + _aligned(nbytes)

    def receive_small(self, status, key, head, size, wanted, found):
        """Receive what has arrived, as receive() does, except the packets that are
        exactly one small tensor under key with this header (``head``, ``size``
        bytes in all) from a rank in ``wanted``, the first under (rank, key): those
        go to found as (rank, packet), their ranks leave wanted, and the caller
        reads them without an Entry (the tensor's bytes start at len(head)). False
        if a packet under key from a rank in wanted was not such a packet (then
        put_back found: the caller goes the general way)."""
        return self._receive_expected(status, key, head, size, wanted, lambda src, packet: (src, packet), found)

    def receive_large(self, status, key, head, nbytes, wanted, found):
        """receive_small for the descriptors of large tensors of nbytes under key with
        this header (large_head): the receive of each one's data is posted at once into
        a pooled buffer, without an Entry, and found gets (rank, request, buffer,
        release). False as receive_small's (then put_back_large found)."""
        def post(src, packet):
            buf, release = self.pool.take(nbytes)
            tag = _TAG.unpack_from(packet, len(head))[0]
            return src, self.comm.Irecv([buf, nbytes, _BYTE], src, tag), buf, release
        return self._receive_expected(status, key, head, len(head) + _ALIGN, wanted, post, found)

    def _receive_expected(self, status, key, head, size, wanted, take, found):
        """receive_small and receive_large: found gets take(rank, packet) for each
        expected packet."""
        improbe, inbox = self.comm.Improbe, self.inbox
        n = len(head)
        regular = True
        msg = improbe(_ANY_SOURCE, STREAM_TAG, status)
        while msg is not None:
            packet = np.empty(status.Get_count(_BYTE), dtype=np.uint8)
            msg.Recv([packet, _BYTE])
            src = status.Get_source()
            if (src in wanted and packet.size == size and not inbox.get((src, key))
                    and packet[:n].tobytes() == head):
                found.append(take(src, packet))
                wanted.discard(src)
            else:
                self._unpack(src, packet)
                if src in wanted and inbox.get((src, key)):
                    regular = False
            msg = improbe(_ANY_SOURCE, STREAM_TAG, status)
        return regular

    def put_back(self, found, key):
        """File the packets receive_small put in found in the inbox, each first under
        its (rank, key), as receive() would have."""
        for src, packet in found:
            self._unpack(src, packet)
            self.inbox[(src, key)].rotate(1)     # (anything filed under it came later)

    def put_back_large(self, found, key, meta):
        """File what receive_large put in found in the inbox, each first under its
        (rank, key), with its receive pending, as receive() and post() would have."""
        for src, req, buf, release in found:
            entry = Entry(src, key, meta, True)
            entry.value, entry._release = _as_tensor(buf, meta), release
            self.pending_recvs.append((req, entry))
            self.inbox[(src, key)].appendleft(entry)     # (anything filed under it came later)

    def flush_all(self):
        sent = False
        for dst in list(self.outboxes):
            sent |= self.flush_one(dst) is not None
        return sent

    # ---- receiving -----------------------------------------------------
    def receive(self, status, looks=1):
        """Drain every packet that has arrived; returns True if any did. looks: probes
        that must find nothing before it gives up (one MPICH Improbe may only move a
        waiting message into MPI's queue and find nothing; the next finds it)."""
        improbe = self.comm.Improbe
        msg = improbe(_ANY_SOURCE, STREAM_TAG, status)
        while msg is None and looks > 1:
            looks -= 1
            msg = improbe(_ANY_SOURCE, STREAM_TAG, status)
        if msg is None:
            return False
        while msg is not None:
            packet = np.empty(status.Get_count(_BYTE), dtype=np.uint8)
            msg.Recv([packet, _BYTE])
            self._unpack(status.Get_source(), packet)
            msg = improbe(_ANY_SOURCE, STREAM_TAG, status)
        return True

    def _entries_of(self, header):
        """The entries of a packet's pickled header. A loop sends the same headers
        again and again (same names, shapes and offsets), so they are unpickled once:
        a dict lookup costs a fraction of ``pickle.loads``. Headers with an object
        are not kept: the object is handed to the caller."""
        entries = self._unpickled.get(header)
        if entries is None:
            entries = pickle.loads(header)
            if all(loc is not None for _, _, _, loc in entries):
                _remember(self._unpickled, header, entries)
        return entries

    def _unpack(self, src, packet):
        (hlen,) = _HEAD.unpack_from(packet, 0)
        entries = self._entries_of(packet[_HEAD.size:_HEAD.size + hlen].tobytes())
        start = _aligned(_HEAD.size + hlen)
        for key, kind, meta, loc in entries:
            if kind == _KIND_GROUP:
                self._unpack_group(src, meta, loc, packet, start)
                continue
            marked = kind.__class__ is str
            entry = Entry(src, key, meta, kind == _KIND_TENSOR or marked, kind if marked else None)
            if kind == _KIND_OBJECT:
                entry.value, entry.ready = meta, True
                self.arrived.append((src, key))
            elif loc[0] == "i":
                raw = packet[start + loc[1]:start + loc[1] + loc[2]]
                npdt = _dtypes_of(meta[0])[1]
                if npdt is not None and raw.size:
                    entry.array = np.ndarray(meta[1], npdt, raw)
                else:
                    entry.value = _as_tensor(raw, meta)
                entry.ready = True
                self.arrived.append((src, key))
            else:
                self._announce(entry, packet, start, loc, [(src, key)])
            self.inbox[(src, key)].append(entry)

    def _unpack_group(self, src, meta, loc, packet, start):
        dtype, members = meta
        slab = Slab(src, dtype, members)
        if loc[0] == "i":
            raw = packet[start + loc[1]:start + loc[1] + loc[2]]
            slab.flat, slab.ready = _as_tensor(raw, (dtype, (slab.offsets[-1],))), True
            self.arrived.extend(slab.keys())
        else:
            self._announce(slab, packet, start, loc, slab.keys())
        inbox = self.inbox
        for key, member in zip(slab.keys(), map(Member, itertools.repeat(slab), range(len(slab.names)))):
            q = inbox.get(key)
            if q is None:
                inbox[key] = collections.deque((member,))
            else:
                q.append(member)

    def _announce(self, item, packet, start, loc, keys):
        """A large entry's descriptor came in: its data (on the tag the packet's body
        holds at loc) waits for the engine to post its receive."""
        tag = _TAG.unpack_from(packet, start + loc[1])[0]
        self.unposted.append(LargeReceive(item, tag, loc[2], keys))

    def post(self, large):
        """Post the receive of a LargeReceive into a pooled buffer."""
        item = large.item
        buf, item._release = self.pool.take(large.nbytes)
        if isinstance(item, Slab):
            item.flat = _as_tensor(buf, (item.dtype, (item.offsets[-1],)))
        else:
            item.value = _as_tensor(buf, item.meta)
        req = self.comm.Irecv([buf, large.nbytes, MPI.BYTE], item.src, large.tag)
        self.pending_recvs.append((req, item))

    def test_sends(self):
        """Let go of the packets whose sends have completed (until then they are kept alive)."""
        self.sent_packets = [(r, p) for r, p in self.sent_packets if not r.Test()]

    def test_recvs(self):
        """Mark large-tensor entries whose bytes have arrived as ready, and ring their
        senders back: the operation that sent them completes once its send has."""
        if not self.pending_recvs:
            return False
        still, done = [], False
        for req, entry in self.pending_recvs:
            if req.Test():
                entry.ready = done = True
                self.to_ring.add(entry.src)
                if isinstance(entry, Slab):
                    self.arrived.extend(entry.keys())
                else:
                    self.arrived.append((entry.src, entry.key))
            else:
                still.append((req, entry))
        self.pending_recvs = still
        return done

    def take(self, src, key):
        """Pop the oldest ready entry for (src, key), or None."""
        q = self.inbox.get((src, key))
        if not q or not q[0].ready:
            return None
        entry = q.popleft()
        if not q:
            del self.inbox[(src, key)]
        return entry

    def has(self, src, key):
        q = self.inbox.get((src, key))
        return bool(q) and q[0].ready
