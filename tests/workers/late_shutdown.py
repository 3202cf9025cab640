"""Rank 1 shuts down 2.5 s after the others (stall warning after 1 s): the others'
shutdown must warn naming rank 1, and everyone must still end cleanly."""
import time

import bluefog_lite as bf

bf.init()
if bf.rank() == 1:
    time.sleep(2.5)
print(f"AGENT OK {bf.rank()}", flush=True)
bf.shutdown()
