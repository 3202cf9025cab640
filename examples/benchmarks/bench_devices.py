"""What a CUDA tensor costs in neighbor_allreduce: the same call on a host tensor and on
a device tensor (copied to the host at the call, back at synchronize), next to those two
copies alone, in the same run. Needs a GPU (agents share it).

    mpiexec -n 4 python examples/benchmarks/bench_devices.py [--sizes 4K,1M,16M] [--trials 5]

Columns: milliseconds per blocking call (median of trials, slowest agent), and
device / host, the ratio the copies add.
"""
import argparse

import _bench
import torch

import bluefog_lite as bf
from bluefog_lite._mpi import MPI


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=_bench.size_list, default="4K,1M,16M", help="bytes per tensor, comma-separated")
    _bench.add_common_arguments(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_devices.py needs a CUDA GPU")
    bf.init()
    comm = MPI.COMM_WORLD.Dup()
    rows = []
    for nbytes in args.sizes:
        host = torch.randn(nbytes // 4)
        device = host.cuda()

        def copies():     # one copy each way through page-locked host memory
            staged = torch.empty(host.shape, pin_memory=True)
            staged.copy_(device)
            device.copy_(staged)
            torch.cuda.synchronize()

        def on_device():
            out = bf.neighbor_allreduce(device, name="bench.device")
            torch.cuda.synchronize()
            return out
        methods = {"host": lambda: bf.neighbor_allreduce(host, name="bench.host"), "device": on_device,
                   "copies": copies}
        times = _bench.interleaved(methods, _bench.reps_for(nbytes, hi=args.max_reps), args.trials, comm,
                                   same=[("device", "host")])
        rows.append({"key": {"bytes": nbytes}, "values": {k: v[0] for k, v in times.items()}})
        if bf.rank() == 0:
            ms = {k: v[0] * 1e3 for k, v in times.items()}
            print(f"{_bench.size_label(nbytes):>8}  host {ms['host']:8.3f} ms  device {ms['device']:8.3f} ms  "
                  f"copies alone {ms['copies']:8.3f} ms  device/host {ms['device'] / ms['host']:5.2f}",
                  flush=True)
    if bf.rank() == 0:
        _bench.write_json(args.json, "devices", bf.size(), vars(args), rows)
    bf.shutdown()


if __name__ == "__main__":
    main()
