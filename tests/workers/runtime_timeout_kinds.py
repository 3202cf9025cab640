"""One agent calls neighbor_allreduce under a name that the others use for
hierarchical_neighbor_allreduce (2 emulated machines of 2 agents): the two kinds
send under different keys (the name; (name, part) pairs), so neither sees the
other's data. The stall warnings and timeouts now say that ranks sent data of that
name for another kind of operation (before: only that ranks had not joined), and
the timeout drops that data (before, rank 2 kept its machine peer's and the other
machine's hierarchical data, which fed its next hierarchical call of the name: a
wrong average without an error). A hierarchical call that times out in its machine-local
stage also forgets the other machines' sums (they fed the next call too)."""
import sys
import time

import torch

import bluefog_lite as bf
from bluefog_lite._runtime import state

bf.init()
r = bf.rank()
x = torch.full((4,), float(r))
try:
    if r == 2:
        bf.neighbor_allreduce(x, name="h4")
    else:
        bf.hierarchical_neighbor_allreduce(x, name="h4")
    raise AssertionError(f"rank {r}: the mismatched call completed")
except TimeoutError as e:
    if r == 2:
        assert "ranks [0, 3] sent this agent data of that name for another kind of operation" in str(e), e
except ValueError as e:     # (a machine neighbor whose local stage timed out told it first)
    assert r != 2 and "has no machine sum to send: its call timed out on its machine" in str(e), e
bf.barrier()
# no agent kept data of the failed calls (rank 2 the hierarchical data; ranks 1 and 3 the other
# machine's sums and dtypes, which came before their local stage timed out)
left = [(src, key) for (src, key), q in state().engine.stream.inbox.items()
        if q and (key == "h4" or key[0] == "h4")]
assert not left, f"rank {r} kept data of the failed calls: {left}"
got = bf.neighbor_allreduce(x, name="fresh")      # neighbor operations of other names go on
ins = bf.in_neighbor_ranks()
assert torch.allclose(got, torch.full((4,), (r + sum(ins)) / (len(ins) + 1))), got

# -- a late machine peer: rank 0 times out in its machine-local stage, rank 2 (its machine
# neighbor) in its machine stage. Rank 0 tells rank 2 it has no machine sum (before, rank 2's
# timeout left a drop that ate rank 0's next sum: the next call timed out there)
bf.barrier()
t0 = time.monotonic()
if r == 1:
    time.sleep(4.5)         # (BLUEFOG_OP_TIMEOUT_S=3)
try:
    bf.hierarchical_neighbor_allreduce(torch.full((4,), float(r)), name="late")
except ValueError as e:     # (rank 2, if rank 0's note comes before its own timeout)
    assert r == 2 and "rank 0 has no machine sum to send: its call timed out on its machine" in str(e), e
except TimeoutError:
    pass
time.sleep(max(0.0, t0 + 6.0 - time.monotonic()))
got = bf.hierarchical_neighbor_allreduce(torch.full((4,), 10.0 * r), name="late")
assert torch.allclose(got, torch.full((4,), 15.0)), got      # (the average over all 4: machines average)
bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")
