"""try: ... finally: bf.shutdown(), and rank 1 raises inside: the others wait for it in
a neighbor_allreduce and end the job once it leaves; its exception must be printed
anyway (the job's end kills it before Python would print it)."""
import torch

import bluefog_lite as bf

bf.init()
try:
    if bf.rank() == 1:
        raise ValueError("bad batch on rank 1")
    bf.neighbor_allreduce(torch.ones(3), name="x")
finally:
    bf.shutdown()
