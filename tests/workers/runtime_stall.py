"""Rank 1 joins a neighbor_allreduce late: the others warn (naming the op and rank 1);
with BLUEFOG_OP_TIMEOUT_S the stall becomes an exception on every waiting agent.
Mode "mismatch": pair_gossip partners that do not pair up (warning and timeout
name the rank that sent what the call does not take). Mode "unjoined": one agent
skips a collective topology check that the others wait in (its timeout names it).

Mode "sends": rank 0 sends 1 MB to rank 1 and receives nothing, and rank 1 takes it
4 s late, twice: a blocking call (the quick path, which goes on in the loop for
its sends) and a nonblocking one (the loop; its task ends without ever waiting).
Rank 0's operations wait only for their own sends; the warning must say how long
that was, not the time since the clock's origin."""
import sys
import time

import torch

import bluefog_lite as bf
import topology as topo

bf.init(topology_fn=topo.FullyConnectedGraph)
rank, mode = bf.rank(), sys.argv[1]
if mode == "sends":
    # two sizes: rank 1 has no pooled buffer of either, so it cannot take the data in early
    xs = {"oneway.quick": torch.arange(1 << 18, dtype=torch.float32) + rank,
          "oneway.loop": torch.arange(3 << 17, dtype=torch.float32) + rank}
    one_way = dict(enable_topo_check=False)
    if rank == 0:
        got = [bf.neighbor_allreduce(xs["oneway.quick"], self_weight=1.0, src_weights={}, dst_weights={1: 1.0},
                                     name="oneway.quick", **one_way)]
        got.append(bf.synchronize(bf.neighbor_allreduce_nonblocking(
            xs["oneway.loop"], self_weight=1.0, src_weights={}, dst_weights={1: 1.0}, name="oneway.loop",
            **one_way)))
        assert all(torch.equal(g, x) for g, x in zip(got, xs.values()))
    elif rank == 1:
        for name, x in xs.items():
            time.sleep(4.0)     # (rank 0's warnings come after 1 s: margin for a loaded host)
            y = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={0: 0.5}, dst_weights={},
                                      name=name, **one_way)
            assert torch.allclose(y, x - 0.5), name
    bf.barrier()
elif mode == "warn":
    if rank == 1:
        time.sleep(3.0)
    y = bf.neighbor_allreduce(torch.ones(3) * rank, name="late.op")
    assert torch.allclose(y, torch.full((3,), (bf.size() - 1) / 2))
elif mode == "mismatch":
    # pair_gossip partners that do not pair up: r targets r + 1, so each agent waits for
    # its successor and holds its predecessor's data, which it does not take. The
    # timeout names both (with BLUEFOG_OP_TIMEOUT_S), and so does the stall warning.
    n = bf.size()
    succ, pred = (rank + 1) % n, (rank - 1) % n
    try:
        bf.pair_gossip(torch.ones(3) * rank, succ, name="mismatched.pairs")
        raise AssertionError("expected a timeout")
    except TimeoutError as e:
        assert f"waiting for ranks [{succ}]; ranks [{pred}] sent this agent data of that name" in str(e), str(e)
    # a consistent gossip under another name still works afterwards
    y = bf.pair_gossip(torch.ones(3) * rank, rank ^ 1, name="paired")
    assert torch.allclose(y, torch.full((3,), (rank + (rank ^ 1)) / 2)), y
    bf.barrier()
elif mode == "unjoined":
    # rank 1 calls in static mode, the others with dst_weights and the topology check
    # (a collective): rank 1 waits for their data, they wait for rank 1 in the check
    x = torch.ones(3) * rank
    try:
        if rank == 1:
            bf.neighbor_allreduce(x, name="mixed.modes")
        else:
            bf.neighbor_allreduce(x, self_weight=0.5, src_weights={r: 0.5 / 2 for r in bf.in_neighbor_ranks()},
                                  dst_weights=bf.out_neighbor_ranks(), enable_topo_check=True, name="mixed.modes")
        raise AssertionError("expected a timeout")
    except TimeoutError as e:
        if rank == 1:
            assert "wait in the collective NEIGHBOR_ALLREDUCE 'mixed.modes' (a topology check" in str(e), str(e)
            assert f"waiting for ranks {bf.in_neighbor_ranks()}; ranks [0, 2, 3] wait" in str(e), str(e)
        else:
            assert "waiting for ranks [1]" in str(e), str(e)
else:  # fatal: rank 1 never joins; everybody else must get a TimeoutError naming rank 1
    if rank != 1:
        try:
            bf.neighbor_allreduce(torch.ones(3), name="never.joined")
            raise AssertionError("expected a timeout")
        except TimeoutError as e:
            assert "never.joined" in str(e) and "[1]" in str(e), str(e)
    else:
        time.sleep(3.0)   # the others time out after ~2 s, then all meet in the barrier
    bf.barrier()   # everyone, rank 1 included, is still healthy afterwards
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)
