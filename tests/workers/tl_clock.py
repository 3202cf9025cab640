"""The clock offset to rank 0 measured at init. argv[1] "shared": every agent runs
under rank 0's kernel (this host), so it reads rank 0's clock: offset exactly 0,
no exchange. "measured": each agent pretends another boot id (as on another host),
so the NTP-style exchange runs; on this host the true offset is 0, and the
estimate must be within half its round trip."""
import sys

import bluefog_lite as bf
from bluefog_lite._mpi import MPI
from bluefog_lite.timeline import _clock, _control

mode = sys.argv[1]
if mode == "measured":
    real = _clock.boot_id
    _clock.boot_id = lambda: f"{real()}-{MPI.COMM_WORLD.rank}"
bf.init()
r = bf.rank()
offset, rtt, shared = _control._clock_sync
if r == 0 or mode == "shared":
    assert (offset, rtt, shared) == (0.0, 0.0, True), (r, _control._clock_sync)
else:
    assert shared is False and rtt > 0 and abs(offset) <= rtt / 2 + 1.0, (r, _control._clock_sync)
bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")
