"""Rank 1 shuts down 2.5 s after the others (stall warning after 1 s): the others'
shutdown must warn naming rank 1, and everyone must still end cleanly. With argv
"window", a window exists: shutdown's win_free waits for rank 1 too, past
BLUEFOG_OP_TIMEOUT_S (a timeout there left rank 1 in MPI's collective free for good)."""
import sys
import time

import torch

import bluefog_lite as bf

bf.init()
if sys.argv[1:] == ["window"]:
    bf.win_create(torch.zeros(3), "w")
if bf.rank() == 1:
    time.sleep(2.5)
print(f"AGENT OK {bf.rank()}", flush=True)
bf.shutdown()
