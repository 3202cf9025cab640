"""An operation whose result is ready but whose large send (1 MB) a receiver has not
taken: argv[1] "timeout" (BLUEFOG_OP_TIMEOUT_S=1.5): rank 1 takes it only after 4 s,
rank 0's call times out naming rank 1 (the wait for its own sends never timed out),
and rank 1 still gets the data; "departed": rank 1 shuts down without taking it, and
rank 0 ends the job naming it instead of waiting forever; "stale": rank 0's call has
its input at once and times out on its send only: its next call of the name still
gets rank 1's next data (the timeout used to drop it as a late input)."""
import sys
import time

import numpy as np
import torch

import bluefog_lite as bf

bf.init()
r = bf.rank()
x = torch.arange(1 << 18, dtype=torch.float32)      # 1 MB: its own message, taken by the receiver
mode = sys.argv[1]
if mode == "stale":
    if r == 0:
        time.sleep(0.5)     # rank 1's data is in first: the call takes it without waiting
        try:
            bf.neighbor_allgather(x.view(-1, 1), src_ranks=[1], dst_ranks=[1], enable_topo_check=False, name="x")
            raise AssertionError("rank 0: the call returned before its send was taken")
        except TimeoutError as e:
            assert "for the completion of its own sends (ranks [1] have not taken them)" in str(e), e
        got = bf.neighbor_allgather(torch.zeros(0, 1), src_ranks=[1], dst_ranks=[], enable_topo_check=False,
                                    name="x")
        np.testing.assert_array_equal(got.numpy().ravel(), np.full(4, 2.0))
    else:
        bf.neighbor_allgather(torch.full((4, 1), 1.0), src_ranks=[], dst_ranks=[0], enable_topo_check=False,
                              name="x")
        time.sleep(3.0)
        bf.neighbor_allgather(torch.full((4, 1), 2.0), src_ranks=[], dst_ranks=[0], enable_topo_check=False,
                              name="x")
elif r == 0:
    try:
        bf.neighbor_allreduce(x, self_weight=1.0, src_weights={}, dst_weights=[1], enable_topo_check=False,
                              name="oneway")
        raise AssertionError("rank 0: the call returned before its send was taken")
    except TimeoutError as e:
        assert mode == "timeout", e
        assert "for the completion of its own sends (ranks [1] have not taken them)" in str(e), e
elif mode == "timeout":
    time.sleep(4.0)
    got = bf.neighbor_allreduce(torch.zeros_like(x), self_weight=0.0, src_weights={0: 1.0}, dst_weights=[],
                                enable_topo_check=False, name="oneway")
    np.testing.assert_array_equal(got.numpy(), x.numpy())
bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")
