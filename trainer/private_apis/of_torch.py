"""torch's private APIs (the table in trainer/private_apis/__init__.py); checked against torch 2.11.0 and 2.13.0
(tests/unit/private_apis/test_of_torch.py, run under both in CI)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.amp import GradScaler
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.nn.parallel import distributed as ddp_module
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.units import MIB

__all__ = [
    "CheckpointImpl",
    "checkpoint_wrapper",
    "comm_hook_states",
    "ddp_bucket_assignment",
    "ddp_default_bucket_cap_mb",
    "ddp_ignore_params",
    "FLIGHT_RECORDER_DUMPS",
    "flight_recorder_dumps",
    "flight_recorder_json",
    "flatten_mesh",
    "concatenate_meshes",
    "prebuilt_secondary_mesh",
    "all_gather_autograd",
    "all_to_all_autograd",
    "all_to_all_uneven_autograd",
    "found_inf_per_device",
    "HigherOrderOperator",
    "import_rank_lazy_modules",
    "inductor_cache_dir",
    "interleaved_1f1b_order",
    "name_rendezvous_events_cheaply",
    "new_mem_tracker",
    "dump_memory_snapshot",
    "record_memory_history",
    "stop_memory_history",
    "storage_key",
    "tensor_storages",
    "TorchDispatchMode",
    "tree_leaves",
    "OpOverload",
    "OpOverloadPacket",
    "powersgd_hook_in_this_thread",
    "scale_on_device",
    "set_last_lr",
]


FLIGHT_RECORDER_DUMPS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")
"""c10d's flight-recorder JSON dumps, NCCL's first: ProcessGroupNCCL's own (ProcessGroupNCCL.hpp
`dump_nccl_trace_json`, CUDA wheels only) and the generic one (FlightRecorder.hpp) that gloo writes to."""


def flight_recorder_dumps() -> tuple[str, ...]:
    """The flight-recorder dumps this torch build has."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    return tuple(name for name in FLIGHT_RECORDER_DUMPS if getattr(c10d, name, None) is not None)


def flight_recorder_json(name: str = "_dump_fr_trace_json") -> str | None:
    """One flight recorder, every entry with its collectives and without stack traces, as JSON;
    None where this torch build has no such dump. Raises what the dump raises (RuntimeError)."""
    dump = getattr(getattr(torch._C, "_distributed_c10d", None), name, None)
    return None if dump is None else dump(True, False)


def comm_hook_states(model: torch.nn.Module) -> list[object]:
    """The states of the communication hooks registered on a DDP model (DistributedDataParallel's
    `_comm_hooks`, appended by register_comm_hook); none for any other module."""
    return [state for _, state in getattr(model, "_comm_hooks", [])]


def record_memory_history(max_entries: int) -> None:
    """Start the CUDA caching allocator's history: every allocation and free with its Python stack
    (`stacks="python"`: C++ frames make a dump take minutes, pytorch/torchtitan#3628), at most
    `max_entries` events kept."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def stop_memory_history() -> None:
    """Stop recording the allocator's history (and drop what was kept)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """The allocator's state and recorded history as a pickle for pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


def inductor_cache_dir() -> str:
    """Where TorchInductor keeps its compile cache in this process: TORCHINDUCTOR_CACHE_DIR, else its
    default, torchinductor_<user> in the temporary directory. Read without creating it (torch's own
    `cache_dir()` creates it and sets the variable)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()


def tensor_storages(tensor: torch.Tensor) -> set[torch.UntypedStorage]:
    """The storages a tensor holds, a wrapper subclass's (float8) inner tensors' included: MemTracker's
    own walk (torch.distributed._tools.common_utils.get_untyped_storages)."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    return get_untyped_storages(tensor)


def storage_key(storage: torch.UntypedStorage) -> int:
    """The address of a storage's StorageImpl (`_cdata`): views share it, and it is unique while the storage
    lives; the key MemTracker's weak dictionary stands in for."""
    return storage._cdata


def new_mem_tracker() -> Any:
    """A fresh MemTracker that keeps the global peak only (`global_peak_mem_tracker`)."""
    return global_peak_mem_tracker()()


@functools.cache
def global_peak_mem_tracker() -> type:
    """MemTracker without its per-module peaks, which zerolab never reads (it reads the global
    `get_tracker_snapshot("peak")`). After every op torch's `_update_peak_stats` walks every module
    seen so far (its `memory_tracking` table) to raise each active one's own peak, then raises the
    global peak: on the tiny model the walk was most of a tracked CPU step's time. Here the table is
    hidden during that call, so torch's own code updates the global peak alone; the module hooks,
    categories and snapshots are untouched. Its post-step registration of an optimizer's state takes, for
    offload=nvme's AdamW, the tensors it holds in memory rather than its file's mapping. (Imported when first
    used: it pulls in FSDP's modules.)"""
    from torch.distributed._tools.mem_tracker import MemTracker

    class GlobalPeakMemTracker(MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            modules, self.memory_tracking = self.memory_tracking, {}
            try:
                super()._update_peak_stats(peak_state)
            finally:
                self.memory_tracking = modules

        def _track_optimizer_states(self, reftype: Any, optimizer: Any) -> None:
            # torch's post-step hook registers every state tensor's storage. An optimizer that says what it holds
            # in memory (offload=nvme's, trainer/rank/nvme.py `in_memory`: its moments are views of a mapped
            # file) is tracked by that instead, else the whole mapping would count from its first step on.
            if not hasattr(optimizer, "in_memory"):
                super()._track_optimizer_states(reftype, optimizer)
                return
            for tensor in optimizer.in_memory():
                self._update_and_maybe_create_winfos(tensor, reftype)

    return GlobalPeakMemTracker


def import_rank_lazy_modules() -> None:
    """Import now what torch imports on first use inside every rank, not when the loop's modules are
    imported: DDP's and FSDP2's constructors import torch._dynamo (about half a CPU-second), and
    MemTracker (`new_mem_tracker`) pulls in its module at a CPU rank's first tracked step. The fork
    server does, once, so no rank forked from it does. (Plain imports: the rank path's import rules,
    tests/unit/test_imports.py, read every module it loads.)"""
    import torch._dynamo  # noqa: F401
    import torch.distributed._tools.mem_tracker  # noqa: F401


def name_rendezvous_events_cheaply() -> None:
    """Name the elastic launcher's rendezvous events as torch does, at a fraction of the cost.

    torch's `dynamic_rendezvous.get_method_name` names each event after the method that records it
    with `inspect.stack()`, twice: that reads the source line of every frame on the stack and, for a
    frame without a module file (runpy's), scans every loaded module. A one-node job records nine
    events: about half a CPU-second of each job's launcher process, measured. `caller_name` takes the
    same frame's name from the frame itself. The launcher process calls this before it launches."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = caller_name


def caller_name(depth: int = 2) -> str:
    """What torch's `get_method_name(depth)` returns, `inspect.stack()[depth].function` (0: this
    function's own frame), or "no_method_name" where the stack is not that deep."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is shallower than `depth`
        return "no_method_name"


def found_inf_per_device(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
    """The scaler's found-inf record for `optimizer` (filled by unscale_, cleared by update)."""
    return scaler._found_inf_per_device(optimizer)


def scale_on_device(scaler: GradScaler) -> torch.Tensor:
    """The scaler's current scale tensor, without a host sync."""
    return scaler._get_scale_async()


def set_last_lr(scheduler: LRScheduler, lrs: list[float]) -> None:
    """What `scheduler.get_last_lr()` returns from now on."""
    scheduler._last_lr = lrs


def ddp_bucket_assignment(shapes: list[tuple[int, ...]], cap_mb: float | None) -> list[list[int]]:
    """The buckets DDP's reducer makes of fp32 gradients of `shapes` ready in this order, as indices into
    `shapes`: torch's own assignment (`_compute_bucket_assignment_by_size`, run on meta tensors), its
    first bucket capped at `_DEFAULT_FIRST_BUCKET_BYTES` where no cap is set, else at the cap, as
    DistributedDataParallel and the reducer's rebuild after the first step do (nn/parallel/distributed.py)."""
    cap = int((cap_mb or ddp_default_bucket_cap_mb()) * MIB)
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", MIB) if cap_mb is None else cap
    tensors = [torch.empty(shape, device="meta") for shape in shapes]
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap])
    return indices


def ddp_default_bucket_cap_mb() -> float:
    """DDP's bucket cap where `bucket_cap_mb` is not given (25 MiB in torch 2.13, taken as that
    where a torch release drops the constant)."""
    return getattr(ddp_module, "_DEFAULT_BUCKET_CAP_MB", 25)


def ddp_ignore_params(module: torch.nn.Module, names: list[str]) -> None:
    """Have the DistributedDataParallel that will wrap `module` leave these parameters (fully qualified
    names) out of its init broadcast, its buckets and its all-reduce: torch's own switch for it,
    `_set_params_and_buffers_to_ignore_for_model`, whose public form pytorch/pytorch#43690 never settled.
    Expert parallelism (trainer/rank/experts.py) holds different experts on each rank, so there is nothing
    to broadcast or average."""
    ddp_module.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


class CompletedCollectives:
    """torch.distributed, but an all_reduce returns its work once the collective has completed."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        work = dist.all_reduce(*args, **kwargs)
        if work is not None:  # async_op=True: wait for it before the caller chains a callback on it
            work.get_future().wait()
        return work


def powersgd_hook_in_this_thread(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, every callback of it run in the calling thread, which it returns after.

    The hook chains its P and Q all-reduces, the new error feedback and the decompression in
    `fut.then(...)` callbacks of its first all-reduce. A callback runs where its future completes:
    gloo completes it on a worker thread, where neither the memory tracker (a thread-local dispatch
    mode) sees what the callbacks allocate nor autograd's next bucket waits for them (two ranks can
    then issue different collectives under one sequence number: gloo aborts, size mismatch).
    `Future.then` does not carry the caller's thread-local state into a callback (c10 has
    `at::wrapPropagateTLSState`; the Python binding's `then` does not use it, and Python has no handle
    on that state), and the callbacks are closures inside the hook; so, for the call, the hook's module sees an all_reduce that returns its work
    completed: `then` on a completed future runs the callback at once, in this thread. The hook
    computes the same in the same order; only the thread its callbacks run on changes."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as module

    with mock.patch.object(module, "dist", CompletedCollectives()):
        return module.powerSGD_hook(state, bucket)


def interleaved_1f1b_order(
    pp: int, local_stages: int, micro_batches: int, rank: int
) -> list[tuple[int, bool]]:
    """The order in which ScheduleInterleaved1F1B runs one rank's work: (stage index, forward?) per action.

    torch computes it in `ScheduleInterleaved1F1B._calculate_single_rank_operations`, a method that reads
    four attributes; a schedule object itself needs live stages and a process group, which the plan (made
    before any rank exists) has not, so the method is called on those four attributes as its __init__ sets them.
    """
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, micro_batches // pp)
    attributes = SimpleNamespace(
        n_local_stages=local_stages,
        pp_group_size=pp,
        _n_microbatches=micro_batches,
        microbatches_per_round=micro_batches // rounds,
    )
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(attributes, rank)  # type: ignore[arg-type]
    return [
        (action.stage_index, action.computation_type.name == "FORWARD")
        for action in actions
        if action is not None
    ]


def flatten_mesh(mesh: Any, name: str) -> Any:
    """One dim `name` of every dim of `mesh` (a sub-mesh of adjacent dims), registered on the root mesh."""
    return mesh._flatten(name)


def concatenate_meshes(root: Any, meshes: list[Any]) -> Any:
    """One mesh of the dims of `meshes`, sub-meshes of `root` (HSDP's replicate dim and its flattened shard dim),
    over their process groups: torch's FSDP2 builds its own HSDP mesh so (torch 2.13 _fsdp_init.py). Slicing
    `root` by the dims' names gives the same mesh, but warns that slicing a flattened dim will be deprecated;
    where a torch has no `_concatenate` (guarded), that slice."""
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None:
        return root[tuple(name for mesh in meshes for name in mesh.mesh_dim_names)]
    return concatenate(meshes)


def prebuilt_secondary_mesh(secondary: Any) -> Any:
    """hpZ: a context inside which fully_shard(reshard_after_forward=H) takes `secondary` as its post-forward mesh
    rather than building one. torch builds it with `DeviceMesh(mesh.mesh.view(-1, H))` (torch 2.13 _fsdp_init.py
    `_get_post_forward_mesh_info`), whose process groups every rank of the world must make alike; a pipeline
    stage's mesh holds its own ranks only, so the stages would make different groups at once and hang.
    `secondary` is that same mesh, made by every rank at once (trainer/rank/mesh.py `secondary_mesh`)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    original = _fsdp_init._get_post_forward_mesh_info

    def post_forward_mesh_info(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
        if isinstance(reshard_after_forward, bool):
            return original(reshard_after_forward, mesh_info)
        wanted = mesh_info.mesh.mesh.view(-1, reshard_after_forward)
        assert torch.equal(wanted, secondary.mesh), (wanted, secondary.mesh)
        return _fsdp_init.HSDPMeshInfo(secondary, shard_mesh_dim=1, replicate_mesh_dim=0)

    # fully_shard calls it by the name _fully_shard.py imported; _fsdp_init.py by its own
    patched = contextlib.ExitStack()
    for module in (_fully_shard, _fsdp_init):
        patched.enter_context(
            mock.patch.object(module, "_get_post_forward_mesh_info", post_forward_mesh_info)
        )
    return patched


def all_gather_autograd(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `tensor` along dim 0, rank after rank; its backward reduce-scatters (sums) the gradient.
    torch 2.13 names it all_gather_single_autograd, 2.11 all_gather_tensor_autograd."""
    from torch.distributed import _functional_collectives as funcol

    if hasattr(funcol, "all_gather_single_autograd"):
        return funcol.all_gather_single_autograd(tensor, 0, group)
    # torch 2.11's backward reduce-scatters the gradient as it comes, and refuses one that is not contiguous
    # (a sum's expanded ones); 2.13's takes any.
    return ContiguousGradient.apply(funcol.all_gather_tensor_autograd(tensor, 0, group))


class ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient (for torch 2.11's all-gather above)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def all_to_all_autograd(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal blocks of dim 0 exchanged over `group` (block i to rank i, in rank order), with autograd (the
    backward exchanges the gradient back)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_to_all_single_autograd(tensor, None, None, group)


def all_to_all_uneven_autograd(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows of dim 0 exchanged over `group`, `input_splits[i]` of them to rank i and `output_splits[i]` from it,
    with autograd (the backward sends the gradient back the same way): expert parallelism's dispatch."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_to_all_single_autograd(tensor, output_splits, input_splits, group)
