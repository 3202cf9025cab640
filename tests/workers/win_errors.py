"""Bad input to window operations: a clear error on every agent that can know it,
no hang when only one agent passes bad input to a collective, the engine still
usable afterwards; an operation racing win_free on another thread raises clearly;
set_topology refuses while windows exist; shutdown frees
windows that are left."""
import sys
import warnings

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo

bf.init()
rank, size = bf.rank(), bf.size()
IN, OUT = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()
NON_OUT = [r for r in range(size) if r != rank and r not in OUT]
NON_IN = [r for r in range(size) if r != rank and r not in IN]


def raises(exc, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"{exc.__name__} without {text!r}: {e}"
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc.__name__} ({text!r})")


x = torch.zeros(3, 2)
assert bf.win_create(x, "e")

# -- collective: bad input on some agents raises the same error on all of them ------------------
raises(ValueError, "already exists", bf.win_create, x, "e")
msg = raises(ValueError, "different windows", bf.win_create, torch.zeros(3 + (rank == 1), 2), "shape")
assert "rank 1: 'shape' float32[4, 2]" in msg, msg
raises(ValueError, "different windows", bf.win_create, x, f"name{rank % 2}")
raises(TypeError, "rank 2: tensor must be a torch.Tensor", bf.win_create,
       [1.0] if rank == 2 else x, "not_a_tensor")
raises(TypeError, "dtypes", bf.win_create, torch.zeros(3, dtype=torch.bool), "bools")
raises(ValueError, "already exists", bf.win_create, x if rank else torch.zeros(1), "e" if rank == 3 else "new")
assert bf.get_current_created_window_names() == ["e"], bf.get_current_created_window_names()
raises(ValueError, "no window named 'nope'", bf.win_free, "nope" if rank == 0 else "e")
assert bf.get_current_created_window_names() == ["e"]
raises(ValueError, "no window named 'nope'", bf.win_free, "nope")


def free_inside_own_mutex():
    with bf.win_mutex("e", for_self=True):
        bf.win_free("e")


def free_inside_mutex_on_one_agent():
    if rank == 0:
        with bf.win_mutex("e", for_self=True):
            bf.win_free("e")
    else:
        bf.win_free("e")


raises(ValueError, "rank 0: window 'e' is freed inside this agent's win_mutex block", free_inside_own_mutex)
raises(ValueError, "rank 0: window 'e' is freed inside this agent's win_mutex block",
       free_inside_mutex_on_one_agent)
assert bf.get_current_created_window_names() == ["e"]

# -- unknown window name in every op -------------------------------------------------------------
for fn, args in ((bf.win_put, (x, "nope")), (bf.win_accumulate, (x, "nope")), (bf.win_get, ("nope",)),
                 (bf.win_update, ("nope",)), (bf.win_update_then_collect, ("nope",)),
                 (bf.win_put_nonblocking, (x, "nope")), (bf.get_win_version, ("nope",)),
                 (bf.win_associated_p, ("nope",)), (bf.win_get_nonblocking, ("nope",))):
    raises(ValueError, "no window named 'nope'", fn, *args)
raises(ValueError, "no window named 'nope'", bf.win_mutex("nope").__enter__)

# -- tensors that do not match the window --------------------------------------------------------
raises(ValueError, "does not match window 'e'", bf.win_put, torch.zeros(2, 3), "e")
raises(ValueError, "does not match window 'e'", bf.win_accumulate, torch.zeros(3, 2, dtype=torch.float64), "e")
raises(TypeError, "must be a torch.Tensor", bf.win_put, [0.0] * 6, "e")
for fn in (bf.win_put, bf.win_accumulate):
    raises(TypeError, "tensor is sparse; pass a dense tensor", fn, torch.zeros(2, 3).to_sparse(), "e")
    # scaled in place by self_weight: refused before anything is sent
    raises(ValueError, "with self_weight: the tensor's elements share memory", fn,
           torch.ones(1, 1).expand(3, 2), "e", self_weight=0.5)
    raises(TypeError, "require_mutex must be True or False, got None", fn, x, "e", require_mutex=None)

# -- flags are True or False, not anything with a truth value ---------------------------------------
raises(TypeError, "win_get: require_mutex must be True or False, got 'yes'", bf.win_get, "e", require_mutex="yes")
raises(TypeError, "win_update: reset must be True or False, got 1", bf.win_update, "e", reset=1)
raises(TypeError, "win_update: clone must be True or False, got None", bf.win_update, "e", clone=None)
raises(TypeError, "win_mutex: for_self must be True or False, got 0", bf.win_mutex("e", for_self=0).__enter__)
raises(TypeError, "zero_init must be True or False, got 'no'", bf.win_create, torch.zeros(2), "z", zero_init="no")
assert bf.win_update("e", reset=np.bool_(False)).shape == (3, 2)     # numpy bools are bools

# -- ranks out of range / not neighbors / self -----------------------------------------------------
raises(ValueError, "out of range", bf.win_put, x, "e", dst_weights={size: 1.0})
raises(ValueError, "out of range", bf.win_put, x, "e", dst_weights=[-1])
raises(ValueError, "this agent itself", bf.win_accumulate, x, "e", dst_weights={rank: 1.0})
if NON_OUT:
    raises(ValueError, "not out-neighbors", bf.win_put, x, "e", dst_weights={NON_OUT[0]: 0.5})
if NON_IN:
    raises(ValueError, "not in-neighbors", bf.win_get, "e", src_weights={NON_IN[0]: 1.0})
    raises(ValueError, "not in-neighbors", bf.win_update, "e", 0.5, {NON_IN[0]: 0.5})
raises(ValueError, "out of range", bf.win_get, "e", src_weights={size + 3: 1.0})
raises(ValueError, "given together", bf.win_update, "e", self_weight=0.5)
raises(TypeError, "must be a real number", bf.win_put, x, "e", self_weight="half")
raises(ValueError, "out of range", bf.win_mutex("e", ranks=[size]).__enter__)
raises(TypeError, "dict", bf.win_put, x, "e", dst_weights=0.5)

# -- the window and the engine still work ---------------------------------------------------------
bf.win_put(torch.ones(3, 2), "e")
bf.barrier()
assert torch.equal(bf.win_update("e", 0.0, {s: 1.0 for s in IN}), torch.full((3, 2), float(len(IN))))
y = bf.neighbor_allreduce(torch.full((2,), float(rank)), name="still.works")
assert torch.allclose(y, torch.full((2,), (rank + sum(IN)) / (len(IN) + 1))), y    # uniform weights

# -- set_topology refuses while a window exists -----------------------------------------------------
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert bf.set_topology(topo.RingGraph(size)) is False
assert any("refused" in str(w.message) for w in caught)
bf.win_free()
assert bf.get_current_created_window_names() == []
assert bf.set_topology(topo.RingGraph(size)) is True

# -- a window freed while another thread still uses it: that thread's next operation on it
#    raises a clear error (it found MPI's window gone: internal TypeError/AttributeError before)
import threading  # noqa: E402
import time  # noqa: E402

bf.win_create(torch.zeros(1000), "raced")
errors = []


def user(kind):
    x = torch.ones(1000)
    while True:
        try:
            if kind == "put":
                bf.win_wait(bf.win_put_nonblocking(x, "raced"))
            elif kind == "update":
                bf.win_update("raced")
            elif kind == "version":
                bf.get_win_version("raced")
            else:
                bf.win_associated_p("raced")
        except Exception as e:      # what is raised is the point
            errors.append((kind, type(e).__name__, str(e)))
            return
        if kind != "p":     # (p without a pause: its read of freed memory was a bare TypeError)
            time.sleep(0.001)


users = [threading.Thread(target=user, args=(k,)) for k in ("put", "update", "version", "p")]
for t in users:
    t.start()
time.sleep(0.2)
bf.barrier()
bf.win_free("raced")
for t in users:
    t.join()
expected = ("window 'raced' was freed (win_free) before this operation on it ran", "no window named 'raced'",
            "get_win_version: window 'raced' is being freed (win_free)",
            "win_associated_p: window 'raced' is being freed (win_free)")
assert len(errors) == 4 and all(exc == "ValueError" and any(w in text for w in expected)
                                for _, exc, text in errors), errors

# -- shutdown frees the windows that are left --------------------------------------------------------
bf.win_create(torch.ones(4), "left.open")
bf.win_create(torch.ones(4), "left.open.too", zero_init=True)
bf.shutdown()
bf.init()          # a new start: the windows shutdown freed are gone, their names free again
assert bf.get_current_created_window_names() == []
assert bf.win_create(torch.ones(4), "left.open")
bf.shutdown()
sys.stdout.write(f"AGENT OK {rank}\n")
