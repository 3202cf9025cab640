"""Random argument combinations fed to the public operations (tests/test_fuzz.py).

argv: SEED CALLS. Every agent draws the calls from one shared random stream (same
seed), so all agents make the same call; each agent's tensor comes from its own
stream and every agent can compute every agent's input. Each call is either valid
(its result must match a numpy reference: the mixing matrix, the explicit weights,
the send pattern) or invalid in a way the expected agents can detect (they must
raise the expected exception type with words naming the problem; the others must
still return right numbers). Agents check their own outcome; rank 0 prints a
summary of everyone's. A hang is turned into an error by BLUEFOG_OP_TIMEOUT_S and
by the test's outer timeout.

Integers are computed by the library in float64 and rounded, so an integer result
may differ from the exact value by at most 0.5 (a tie can round either way); values
and weights are kept small enough that nothing overflows. Half-precision results get
a tolerance that fits their 8-11 bit mantissas.
"""
import collections
import os
import sys

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo
from bluefog_lite.ops import _allgather_object

SEED, CALLS = int(sys.argv[1]), int(sys.argv[2])
bf.init()
RANK, SIZE = bf.rank(), bf.size()
rng = np.random.default_rng(SEED)        # shared: every agent draws the same calls

# name -> (torch dtype, kind, tolerance of results)
DTYPES = {"float32": (torch.float32, "f", 1e-4), "float64": (torch.float64, "f", 1e-9),
          "float16": (torch.float16, "f", 0.06), "bfloat16": (torch.bfloat16, "f", 0.2),
          "int64": (torch.int64, "i", 0.5), "int32": (torch.int32, "i", 0.5),
          "int16": (torch.int16, "i", 0.5), "int8": (torch.int8, "i", 0.5),
          "uint8": (torch.uint8, "u", 0.5), "bool": (torch.bool, "b", 0)}
NUMERIC = [d for d in DTYPES if d != "bool"]
REDUCIBLE = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8"]


class Expect:
    """What this agent must see: a value (float64 array, within tol, of dtype) or an error."""

    def __init__(self, value=None, tol=0.0, dtype=None, error=None, words=()):
        self.value, self.tol, self.dtype, self.error, self.words = value, tol, dtype, error, words


def error(exc, *words):
    return Expect(error=exc, words=words)


# ---- drawing calls (shared stream) ----------------------------------------------------------

def draw(options, p=None):
    return options[rng.choice(len(options), p=p)]


def draw_shape(min_ndim=0):
    ndim = int(rng.integers(min_ndim, 4))
    return tuple(int(d) for d in rng.integers(0 if rng.random() < 0.15 else 1, 4, size=ndim))


def draw_weight(dtype_name, scale=1.0):
    kind = DTYPES[dtype_name][1]
    if kind == "u":
        return float(rng.uniform(0.0, 0.5)) * scale
    if dtype_name == "int8":
        return float(rng.uniform(-0.4, 0.4)) * scale
    return float(rng.uniform(-0.5, 1.0)) * scale


def tensor(call, r, shape, dtype_name):
    """Agent r's input for this call (any agent can compute it)."""
    g = np.random.default_rng([SEED, call, r])
    dt, kind, _ = DTYPES[dtype_name]
    if kind == "b":
        return torch.from_numpy(np.asarray(g.random(shape) < 0.5))
    if kind == "f":
        return torch.from_numpy(np.asarray(g.normal(size=shape))).to(dt)
    low, high = (0, 20) if kind == "u" else (-10, 10)
    return torch.from_numpy(np.asarray(g.integers(low, high + 1, size=shape))).to(dt)


def f64(t):
    return t.to(torch.float64).numpy()


def scaled_ref(x, w, dtype_name):
    """What a sender scaled by w sends (the library rounds integers after scaling)."""
    return np.round(x * w) if DTYPES[dtype_name][1] in "iu" else x * w


# ---- topology state ---------------------------------------------------------------------------

BUILDERS = [topo.ExponentialGraph, topo.RingGraph, topo.StarGraph, topo.MeshGrid2DGraph,
            topo.SymmetricExponentialGraph, topo.FullyConnectedGraph, topo.ExponentialTwoGraph]


class Topology:
    def __init__(self, builder, weighted):
        self.G, self.weighted = builder(SIZE), weighted
        W = topo.mixing_matrix(self.G)
        self.ins = [sorted(i for i in range(SIZE) if i != r and W[i, r] != 0) for r in range(SIZE)]
        self.outs = [sorted(j for j in range(SIZE) if j != r and W[r, j] != 0) for r in range(SIZE)]
        if not weighted:   # uniform 1/(in-degree + 1) on the receiving side
            W = np.zeros((SIZE, SIZE))
            for r in range(SIZE):
                for i in self.ins[r] + [r]:
                    W[i, r] = 1.0 / (len(self.ins[r]) + 1)
        self.W = W


def set_random_topology():
    builder, weighted = draw(BUILDERS), bool(rng.random() < 0.5)
    assert bf.set_topology(builder(SIZE), is_weighted=weighted)
    return Topology(builder, weighted)


# ---- the calls ------------------------------------------------------------------------------------

def meta(t):
    return (t.dtype, tuple(t.shape))


def with_one_odd_agent(call, shape, dtype_name, min_ndim=0):
    """Inputs of every agent; with some probability one agent's has another trailing
    shape or dtype. Returns (inputs, odd agent or None)."""
    xs = [tensor(call, r, shape, dtype_name) for r in range(SIZE)]
    odd = None
    mode = draw(["same", "shape", "dtype"], p=[0.8, 0.1, 0.1])
    if mode != "same":
        odd = int(rng.integers(SIZE))
        if mode == "shape":
            other = shape[:-1] + (shape[-1] + 1,) if len(shape) > min_ndim else shape + (1,)
            xs[odd] = tensor(call, odd, other, dtype_name)
        else:
            other = draw([d for d in NUMERIC if d != dtype_name])
            xs[odd] = tensor(call, odd, shape, other)
    return xs, odd


def neighbor_allreduce_static(call, T):
    dtype_name = draw(NUMERIC + ["bool"], p=[0.95 / len(NUMERIC)] * len(NUMERIC) + [0.05])
    shape = draw_shape()
    if dtype_name == "bool":          # every agent: nothing to average
        x = tensor(call, RANK, shape, "bool")
        return lambda: bf.neighbor_allreduce(x, name=f"fz{call}"), error("TypeError", "bool")
    xs, _ = with_one_odd_agent(call, shape, dtype_name)
    sw = [draw_weight(dtype_name) for _ in range(SIZE)]
    srcw = [{j: draw_weight(dtype_name) for j in T.ins[r] if rng.random() < 0.7} for r in range(SIZE)]
    bad = draw(["none", "nan", "stray", "self", "range", "half"], p=[0.75, 0.05, 0.05, 0.05, 0.05, 0.05])
    explicit = bad != "none" or rng.random() < 0.5
    x = xs[RANK]
    kwargs = {"name": f"fz{call}"}
    if explicit:
        kwargs.update(self_weight=sw[RANK], src_weights=dict(srcw[RANK]))
    # bad weights on every agent: each raises before sending anything
    if bad == "nan":
        kwargs.update(self_weight=float("nan"), src_weights=dict(srcw[RANK]))
        return lambda: bf.neighbor_allreduce(x, **kwargs), error("ValueError", "self_weight must be finite")
    if bad == "stray" and all(len(T.ins[r]) < SIZE - 1 for r in range(SIZE)):
        stray = [j for j in range(SIZE) if j != RANK and j not in T.ins[RANK]][0]
        kwargs["src_weights"][stray] = 0.5
        return lambda: bf.neighbor_allreduce(x, **kwargs), error("ValueError", "not in-neighbors")
    if bad == "self":
        kwargs["src_weights"][RANK] = 0.5
        return lambda: bf.neighbor_allreduce(x, **kwargs), error("ValueError", "this agent itself")
    if bad == "range":
        kwargs["src_weights"][SIZE + int(rng.integers(3))] = 0.5
        return lambda: bf.neighbor_allreduce(x, **kwargs), error("ValueError", "out of range")
    if bad == "half":
        kwargs.pop("src_weights")
        return lambda: bf.neighbor_allreduce(x, **kwargs), error("ValueError", "given together")
    if any(meta(xs[j]) != meta(x) for j in T.ins[RANK]):
        return lambda: bf.neighbor_allreduce(x, **kwargs), error("ValueError", "same shape and dtype")
    if explicit:
        ref = sw[RANK] * f64(x) + sum(w * f64(xs[j]) for j, w in srcw[RANK].items())
    else:
        ref = sum(T.W[i, RANK] * f64(xs[i]) for i in T.ins[RANK] + [RANK])
    return lambda: bf.neighbor_allreduce(x, **kwargs), Expect(ref, DTYPES[dtype_name][2], x.dtype)


def send_pattern():
    """Every agent's destinations (0-2 others) and the sources that follow."""
    dsts = [sorted(int(d) for d in rng.choice([j for j in range(SIZE) if j != r],
                                              size=int(rng.integers(0, 3)), replace=False))
            for r in range(SIZE)]
    srcs = [[j for j in range(SIZE) if r in dsts[j]] for r in range(SIZE)]
    return dsts, srcs


def neighbor_allreduce_dynamic(call, T):
    dtype_name = draw(NUMERIC)
    shape = draw_shape()
    xs = [tensor(call, r, shape, dtype_name) for r in range(SIZE)]
    dsts, srcs = send_pattern()
    as_dict = rng.random() < 0.5
    dstw = [{d: (draw_weight(dtype_name) if as_dict else 1.0) for d in dsts[r]} for r in range(SIZE)]
    srcw = [{j: draw_weight(dtype_name) for j in srcs[r]} for r in range(SIZE)]
    sw = [draw_weight(dtype_name) for _ in range(SIZE)]
    check = rng.random() < 0.7
    bad = draw(["none", "unmatched", "range"], p=[0.8, 0.1, 0.1])
    receivers = [r for r in range(SIZE) if srcs[r]]
    x, mine = xs[RANK], dict(srcw[RANK])
    dst_arg = dstw[RANK] if as_dict else list(dsts[RANK])
    if bad == "unmatched" and receivers:
        check = True                 # without the check this would wait forever: never fuzzed
        odd = receivers[int(rng.integers(len(receivers)))]
        if RANK == odd:
            mine.pop(srcs[odd][-1])
    elif bad == "range":             # every agent names a rank that does not exist
        dst_arg = {**dstw[RANK], SIZE: 1.0} if as_dict else list(dsts[RANK]) + [SIZE]
    else:
        bad = "none"

    def run():
        return bf.neighbor_allreduce(x, self_weight=sw[RANK], src_weights=mine, dst_weights=dst_arg,
                                     enable_topo_check=check, name=f"fz{call}")
    if bad == "unmatched":
        return run, error("ValueError", "do not match across agents")
    if bad == "range":
        return run, error("ValueError", "out of range")
    ref = sw[RANK] * f64(x) + sum(w * scaled_ref(f64(xs[j]), dstw[j][RANK], dtype_name)
                                  for j, w in srcw[RANK].items())
    return run, Expect(ref, DTYPES[dtype_name][2], x.dtype)


def neighbor_allgather(call, T):
    dtype_name = draw(list(DTYPES))
    trail = draw_shape()[:2]
    firsts = [int(rng.integers(0, 3)) for _ in range(SIZE)]
    if rng.random() < 0.05:       # every agent passes a 0-d tensor
        x = tensor(call, RANK, (), dtype_name)
        return lambda: bf.neighbor_allgather(x, name=f"fz{call}"), error("ValueError", "at least one dimension")
    xs = [tensor(call, r, (firsts[r],) + trail, dtype_name) for r in range(SIZE)]
    odd = None
    if rng.random() < 0.15:
        odd = int(rng.integers(SIZE))
        other = draw([d for d in DTYPES if d != dtype_name]) if rng.random() < 0.5 else dtype_name
        xs[odd] = tensor(call, odd, (firsts[odd],) + trail + ((1,) if other == dtype_name else ()), other)
    dynamic = rng.random() < 0.5
    if dynamic:
        dsts, srcs = send_pattern()
        orders = [list(rng.permutation(srcs[r])) for r in range(SIZE)]
        src_of = [[int(j) for j in o] for o in orders]
    else:
        dsts, src_of = T.outs, T.ins
    x = xs[RANK]
    kwargs = {"name": f"fz{call}"}
    if dynamic:
        kwargs.update(src_ranks=src_of[RANK], dst_ranks=dsts[RANK], enable_topo_check=bool(rng.random() < 0.5))

    def trailing(t):
        return (t.dtype, tuple(t.shape[1:]))
    if any(trailing(xs[j]) != trailing(x) for j in src_of[RANK]):
        return lambda: bf.neighbor_allgather(x, **kwargs), error("ValueError", "all dimensions but the first")
    parts = [f64(xs[j]) for j in src_of[RANK]]
    ref = np.concatenate(parts) if parts else np.zeros((0,) + tuple(x.shape[1:]))
    return lambda: bf.neighbor_allgather(x, **kwargs), Expect(ref, 0.0, x.dtype)


def allreduce(call, T):
    dtype_name = draw(list(DTYPES))
    shape = draw_shape()
    average = bool(rng.random() < 0.6)
    in_place = rng.random() < 0.3
    if dtype_name not in REDUCIBLE:          # every agent: a dtype allreduce does not reduce
        x = tensor(call, RANK, shape, dtype_name)
        return lambda: bf.allreduce(x, average=average, name=f"fz{call}"), error("TypeError", "supports")
    xs, odd = with_one_odd_agent(call, shape, dtype_name)
    if odd is not None and xs[odd].dtype not in (DTYPES[d][0] for d in REDUCIBLE):
        xs[odd] = tensor(call, odd, shape + (1,), dtype_name)     # keep the mismatch one all agents see
    x = xs[RANK].clone()
    op = bf.allreduce_ if in_place else bf.allreduce

    def run():
        out = op(x, average=average, name=f"fz{call}")
        if in_place:
            assert out is x or torch.equal(out, x), "allreduce_ must write into its argument"
        return x if in_place else out
    if odd is not None:
        return run, error("ValueError", "agents passed different tensors")
    total = sum(f64(t) for t in xs)
    if average:
        ref = np.floor(total / SIZE) if DTYPES[dtype_name][1] in "iu" else total / SIZE
    else:
        ref = total
    tol = DTYPES[dtype_name][2] if DTYPES[dtype_name][1] == "f" else 0.0
    return run, Expect(ref, tol, x.dtype)


def broadcast(call, T):
    dtype_name = draw(list(DTYPES))
    shape = draw_shape()
    root = int(rng.integers(SIZE))
    xs, odd = with_one_odd_agent(call, shape, dtype_name)
    roots = [root] * SIZE
    bad = draw(["none", "root_differs", "range"], p=[0.85, 0.1, 0.05])
    if bad == "root_differs":
        roots[int(rng.integers(SIZE))] = (root + 1) % SIZE
    elif bad == "range":
        roots = [SIZE + int(rng.integers(2))] * SIZE
    x = xs[RANK]
    run = lambda: bf.broadcast(x, roots[RANK], name=f"fz{call}")  # noqa: E731
    if bad == "range":
        return run, error("ValueError", "out of range")
    if bad == "root_differs" or odd is not None:
        return run, error("ValueError", "agents passed different tensors")
    return run, Expect(f64(xs[root]), 0.0, x.dtype)


def allgather(call, T):
    dtype_name = draw(list(DTYPES))
    trail = draw_shape()[:2]
    firsts = [int(rng.integers(0, 3)) for _ in range(SIZE)]
    xs = [tensor(call, r, (firsts[r],) + trail, dtype_name) for r in range(SIZE)]
    odd = None
    if rng.random() < 0.15:
        odd = int(rng.integers(SIZE))
        xs[odd] = tensor(call, odd, (firsts[odd],) + trail + (2,), dtype_name)
    x = xs[RANK]
    run = lambda: bf.allgather(x, name=f"fz{call}")  # noqa: E731
    if odd is not None:
        return run, error("ValueError", "all dimensions but the first")
    return run, Expect(np.concatenate([f64(t) for t in xs]), 0.0, x.dtype)


def pair_gossip(call, T):
    dtype_name = draw(NUMERIC)
    shape = draw_shape()
    order = [int(r) for r in rng.permutation(SIZE)]
    partner = {}
    for a, b in zip(order[::2], order[1::2]):
        partner[a], partner[b] = b, a
    weights = [(draw_weight(dtype_name), draw_weight(dtype_name)) for _ in range(SIZE)]
    given = rng.random() < 0.6
    xs, odd = with_one_odd_agent(call, shape, dtype_name)
    bad = draw(["none", "range", "self"], p=[0.9, 0.05, 0.05])
    x = xs[RANK]
    target = {"none": partner.get(RANK), "range": SIZE, "self": RANK}[bad]
    kwargs = dict(self_weight=weights[RANK][0], pair_weight=weights[RANK][1]) if given else {}
    run = lambda: bf.pair_gossip(x, target, name=f"fz{call}", **kwargs)  # noqa: E731
    if bad == "range":
        return run, error("ValueError", "out of range")
    if bad == "self":
        return run, error("ValueError", "this agent itself")
    if target is None:            # odd agent count: this one sits the round out
        return None, None
    if meta(xs[target]) != meta(x):
        return run, error("ValueError", "same shape and dtype")
    sw, pw = weights[RANK] if given else (0.5, 0.5)
    return run, Expect(sw * f64(x) + pw * f64(xs[target]), DTYPES[dtype_name][2], x.dtype)


def hierarchical_neighbor_allreduce(call, T):
    """Two emulated machines of two agents (BLUEFOG_RANKS_PER_MACHINE=2), default
    machine weights: every agent ends with the global average."""
    dtype_name = draw(NUMERIC)
    shape = draw_shape()
    xs = [tensor(call, r, shape, dtype_name) for r in range(SIZE)]
    x = xs[RANK]
    total = sum(f64(t) for t in xs)
    return (lambda: bf.hierarchical_neighbor_allreduce(x, name=f"fz{call}"),
            Expect(total / SIZE, DTYPES[dtype_name][2], x.dtype))


# ---- windows: a short random sequence against a model of every agent's memory -------------------------

class WindowModel:
    """A window on every agent and a numpy model of its memory: X[r] (the window
    tensor), B[r][j] (r's buffer for in-neighbor j). Integer windows use integer
    weights (exact); float64 windows random ones."""

    def __init__(self, call, T, log):
        self.T, self.log, self.checked = T, log, 0
        self.dtype_name = draw(["float64", "int32"])
        self.shape = draw_shape(min_ndim=1)
        self.exact = self.dtype_name == "int32"
        self.name = f"fzwin{call}"
        self.X = [f64(tensor(call, r, self.shape, self.dtype_name)) for r in range(SIZE)]
        zero = bool(rng.random() < 0.5)
        self.B = [{j: (np.zeros(self.shape) if zero else self.X[r].copy()) for j in T.ins[r]}   # own copies
                  for r in range(SIZE)]
        self.mine = torch.from_numpy(self.X[RANK].copy()).to(DTYPES[self.dtype_name][0])
        bf.win_create(self.mine, self.name, zero_init=zero)

    def weight(self):
        return float(rng.integers(-1, 3)) if self.exact else float(rng.uniform(-0.5, 1.0))

    def scaled(self, x, w):
        return np.round(x * w) if self.exact else x * w

    def verify(self, what, got, want):
        self.checked += 1
        tol = 0.0 if self.exact else 1e-9
        got = f64(got)
        if got.shape != want.shape or not np.allclose(got, want, atol=tol, rtol=tol):
            self.log(f"{what} on window {self.name} gave {got.ravel()[:4]}, expected {want.ravel()[:4]}")

    def puts(self):
        """Every agent puts or accumulates into some out-neighbors; one agent may then
        make a mistake only it can see (one-sided: nobody waits for it)."""
        plans = [({d: self.weight() for d in self.T.outs[r] if rng.random() < 0.7}, bool(rng.random() < 0.5))
                 for r in range(SIZE)]
        mistake = draw(["none", "stray", "shape", "unknown", "nan"], p=[0.6, 0.1, 0.1, 0.1, 0.1])
        culprit = int(rng.integers(SIZE))
        stray = [j for j in range(SIZE) if j != culprit and j not in self.T.outs[culprit]]
        if mistake == "stray" and not stray:
            mistake = "unknown"
        for r, (dstw, acc) in enumerate(plans):
            for d, w in dstw.items():
                sent = self.scaled(self.X[r], w)
                self.B[d][r] = self.B[d][r] + sent if acc else sent
        dstw, acc = plans[RANK]
        op = bf.win_accumulate if acc else bf.win_put
        op(self.mine, self.name, dst_weights=dstw)
        if RANK == culprit and mistake != "none":
            self.mistake(op, mistake, stray)
        bf.barrier()

    def mistake(self, op, mistake, stray):
        words = {"stray": "not out-neighbors", "shape": "does not match window",
                 "unknown": "no window named", "nan": "must be finite"}[mistake]
        self.checked += 1
        try:
            if mistake == "stray":
                op(self.mine, self.name, dst_weights={stray[0]: 1.0})
            elif mistake == "shape":
                op(torch.zeros(self.shape + (1,), dtype=self.mine.dtype), self.name)
            elif mistake == "unknown":
                op(self.mine, self.name + ".nope")
            else:
                op(self.mine, self.name, self_weight=float("nan"))
        except (ValueError, TypeError) as exc:
            if words not in str(exc):
                self.log(f"window mistake {mistake}: {type(exc).__name__}: {exc}")
            return
        self.log(f"window mistake {mistake} was accepted")

    def gets(self):
        """Some agents fetch w * (an in-neighbor's tensor) into their buffer for it."""
        gets = [{s: self.weight() for s in self.T.ins[r] if rng.random() < 0.4} for r in range(SIZE)]
        for r in range(SIZE):
            for s, w in gets[r].items():
                self.B[r][s] = self.scaled(self.X[s], w)
        get_anyway = rng.random() < 0.5       # also with nothing to get (drawn by everyone)
        if gets[RANK] or get_anyway:
            bf.win_get(self.name, src_weights=gets[RANK])
        bf.barrier()
        versions = bf.get_win_version(self.name)
        if set(versions) != set(self.T.ins[RANK]):
            self.log(f"get_win_version keys {sorted(versions)} != in-neighbors {self.T.ins[RANK]}")

    def updates(self):
        """X[r] <- sw X[r] + sum nbw[j] B[r][j]; reset zeroes the buffers used."""
        updates = [(self.weight(), {j: self.weight() for j in self.T.ins[r] if rng.random() < 0.8},
                    bool(rng.random() < 0.3)) for r in range(SIZE)]
        for r, (sw, nbw, reset) in enumerate(updates):
            new = sw * self.X[r] + sum(w * self.B[r][j] for j, w in nbw.items())
            self.X[r] = np.round(new) if self.exact else new
            if reset:
                for j in nbw:
                    self.B[r][j] = np.zeros(self.shape)
        sw, nbw, reset = updates[RANK]
        self.verify("win_update", bf.win_update(self.name, sw, nbw, reset=reset), self.X[RANK])
        self.verify("the window tensor", self.mine, self.X[RANK])
        bf.barrier()


def window_sequence(call, T, steps, log):
    """win_create, then rounds of puts/accumulates, gets, updates (a barrier after
    each), checked against the model; returns the number of checked calls."""
    model = WindowModel(call, T, log)
    for _ in range(steps):
        model.puts()
        model.gets()
        model.updates()
    bf.win_free(model.name)
    return model.checked


# ---- the run ----------------------------------------------------------------------------------------------

OPS = [(neighbor_allreduce_static, 0.24), (neighbor_allreduce_dynamic, 0.2), (neighbor_allgather, 0.15),
       (allreduce, 0.11), (broadcast, 0.09), (allgather, 0.07), (pair_gossip, 0.09),
       (hierarchical_neighbor_allreduce, 0.05)]
failures = []
counts = collections.Counter()


def log(problem):
    failures.append(f"rank {RANK}, call {call}: {problem}")


def outcome_matches(run, expect):
    try:
        got = run()
    except Exception as exc:  # compared with what was expected
        if expect.error is None:
            return f"raised {type(exc).__name__}: {exc}"
        if type(exc).__name__ != expect.error or not all(w in str(exc) for w in expect.words):
            return f"raised {type(exc).__name__}: {exc}; expected {expect.error} with {expect.words}"
        counts["errors"] += 1
        return None
    if expect.error is not None:
        return f"returned instead of raising {expect.error} ({expect.words})"
    if expect.dtype is not None and got.dtype != expect.dtype:
        return f"dtype {got.dtype}, expected {expect.dtype}"
    g = f64(got)
    if g.shape != expect.value.shape:
        return f"shape {g.shape}, expected {expect.value.shape}"
    if not np.allclose(g, expect.value, atol=expect.tol, rtol=expect.tol if expect.tol < 0.5 else 0):
        return f"values {g.ravel()[:4]}, expected {expect.value.ravel()[:4]} (tol {expect.tol})"
    counts["values"] += 1
    return None


T = set_random_topology()
call = 0
for call in range(CALLS):
    if rng.random() < 0.05:
        T = set_random_topology()
        counts["topologies"] += 1
    if rng.random() < 0.02:
        counts["window_calls"] += window_sequence(call, T, int(rng.integers(2, 5)), log)
        continue
    fn = draw([f for f, _ in OPS], p=[p for _, p in OPS])
    run, expect = fn(call, T)
    if run is None:
        continue
    counts[fn.__name__] += 1
    problem = outcome_matches(run, expect)
    if problem:
        log(f"{fn.__name__}: {problem}")
    if rng.random() < 0.1:
        bf.barrier()      # after errors too: every agent is ready for the next call

everyone = _allgather_object((failures, dict(counts)))
bf.shutdown()
if RANK == 0:
    total = collections.Counter()
    for _, c in everyone:
        total.update(c)
    os.write(1, ("FUZZ " + " ".join(f"{k}={v}" for k, v in sorted(total.items())) + "\n").encode())
    for fails, _ in everyone:
        for f in fails[:20]:
            os.write(1, f"FUZZ FAILURE {f}\n".encode())
if not any(f for f, _ in everyone):
    os.write(1, f"AGENT OK {RANK}\n".encode())
