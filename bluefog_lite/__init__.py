"""bluefog_lite: decentralized (neighbor-averaging) training of PyTorch models over MPI.

The public face: it only re-exports. A Bluefog script runs after changing
``import bluefog.torch as bf`` to ``import bluefog_lite as bf``.

Names are imported on first use (PEP 562), so that tools which need none of
torch or MPI (``bftimeline``, ``bfrun``) start in a fraction of a second and do
not initialize MPI.
"""
import importlib

_EXPORTS = {
    "._runtime": (
        "BluefogError", "init", "shutdown", "rank", "size", "local_rank", "local_size", "machine_rank",
        "machine_size", "is_homogeneous", "mpi_threads_supported", "unified_mpi_window_model_supported",
        "nccl_built", "set_skip_negotiate_stage", "get_skip_negotiate_stage", "suspend", "resume", "set_topology",
        "load_topology", "is_topo_weighted", "in_neighbor_ranks", "out_neighbor_ranks", "set_machine_topology",
        "load_machine_topology", "in_neighbor_machine_ranks", "out_neighbor_machine_ranks"),
    ".ops": (
        "poll", "synchronize", "wait", "barrier",
        "allreduce", "allreduce_", "allreduce_nonblocking", "allreduce_nonblocking_",
        "broadcast", "broadcast_", "broadcast_nonblocking", "broadcast_nonblocking_",
        "allgather", "allgather_nonblocking",
        "neighbor_allgather", "neighbor_allgather_nonblocking",
        "neighbor_allreduce", "neighbor_allreduce_nonblocking",
        "hierarchical_neighbor_allreduce", "hierarchical_neighbor_allreduce_nonblocking",
        "pair_gossip", "pair_gossip_nonblocking",
        "InferSourceFromDestinationRanks", "InferDestinationFromSourceRanks"),
    ".optimizers": (
        "CommunicationType", "DistributedAdaptWithCombineOptimizer", "DistributedAdaptThenCombineOptimizer",
        "DistributedGradientAllreduceOptimizer", "DistributedWinPutOptimizer", "DistributedAllreduceOptimizer",
        "DistributedNeighborAllreduceOptimizer", "DistributedHierarchicalNeighborAllreduceOptimizer"),
    "._local_steps": ("register_step_function",),
    ".parameters": ("broadcast_parameters", "allreduce_parameters", "broadcast_optimizer_state"),
    ".windows": (
        "win_create", "win_free", "win_put", "win_put_nonblocking", "win_accumulate",
        "win_accumulate_nonblocking", "win_get", "win_get_nonblocking", "win_update",
        "win_update_then_collect", "win_poll", "win_wait", "win_mutex", "get_win_version",
        "get_current_created_window_names", "turn_on_win_ops_with_associated_p",
        "turn_off_win_ops_with_associated_p", "win_associated_p"),
    ".timeline": (
        "timeline_start_activity", "timeline_end_activity", "timeline_context", "timeline_start",
        "timeline_stop"),
    ".hooks": ("timeline_install_hooks",),
    "topology": (     # as bluefog.torch re-exports them from its topology_util
        "GetRecvWeights", "GetSendWeights", "IsRegularGraph", "IsTopologyEquivalent",
        "ExponentialTwoGraph", "ExponentialGraph", "FullyConnectedGraph", "MeshGrid2DGraph", "RingGraph",
        "StarGraph", "SymmetricExponentialGraph", "GetDynamicOnePeerSendRecvRanks",
        "GetExp2DynamicSendRecvMachineRanks", "GetInnerOuterRingDynamicSendRecvRanks",
        "GetInnerOuterExpo2DynamicSendRecvRanks"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)
__version__ = "0.1.0"


def __getattr__(name):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'bluefog_lite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value      # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
