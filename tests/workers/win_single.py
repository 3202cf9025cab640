"""One agent: windows have no neighbors; every op is a well-defined no-op and
win_update returns the self-weighted tensor."""
import sys

import torch

import bluefog_lite as bf

bf.init()
assert bf.size() == 1
x = torch.arange(4, dtype=torch.float64)
bf.win_create(x, "solo")
assert bf.win_put(x, "solo") and bf.win_accumulate(x, "solo", self_weight=0.5) and bf.win_get("solo")
assert torch.equal(x, torch.arange(4, dtype=torch.float64) * 0.5)
assert bf.get_win_version("solo") == {}
assert torch.equal(bf.win_update("solo"), torch.arange(4, dtype=torch.float64) * 0.5)   # weight 1/(0+1)
assert torch.equal(bf.win_update("solo", 2.0, {}, clone=True), torch.arange(4, dtype=torch.float64))
with bf.win_mutex("solo", for_self=True):
    assert torch.equal(bf.win_update_then_collect("solo", require_mutex=True), x)
bf.win_free()
sys.stdout.write("AGENT OK 0\n")
bf.shutdown()
