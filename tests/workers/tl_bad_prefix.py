"""An unusable BLUEFOG_TIMELINE prefix on some agents: init raises ValueError naming the path there."""
import sys

import bluefog_lite as bf
from bluefog_lite._mpi import MPI

bad_ranks = {int(r) for r in sys.argv[1].split(",")}
try:
    bf.init()
    error = None
except ValueError as e:
    error = e
me = MPI.COMM_WORLD.rank       # MPI was started by init() before the timeline check
if error is not None:
    assert me in bad_ranks, f"rank {me} should have started: {error}"
    expected = sys.argv[2].replace("{rank}", str(me))
    assert expected in str(error), f"error must name {expected!r}: {error}"
    print(f"rank {me} error: {error}", flush=True)
else:
    assert me not in bad_ranks, f"rank {me}: init must reject the timeline prefix"
bf.shutdown()
print(f"AGENT OK {me}", flush=True)
