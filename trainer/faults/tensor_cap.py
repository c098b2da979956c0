"""`device_memory_gib` on CPU: a cap on the bytes this rank's tensors hold, the quantity the plan counts.

On a GPU the cap is the caching allocator's per-process fraction: the allocator refuses past it.
A CPU has no such allocator (torch's DefaultCPUAllocator is a plain malloc with no counter and no
hook), and a process-wide limit (RLIMIT_DATA, which this cap replaced) counts what the plan does not:
allocator retention, Python objects, the telemetry profiler's buffers, gloo's. Those grew by ~92 MiB
over a tiny job's first steps while its tensors stayed under 34 MiB, so a job planned at 40% of its
cap ran out.

So the cap counts what torch's own MemTracker counts (trainer/telemetry/memory.py), the tensor
storages ops create, on every step instead of the tracked ones. MemTracker itself is not reused here:
it attributes every storage to a module and a category after every op, several times a step's cost,
where the cap needs only a running total. This mode keeps that total (a weak reference per storage,
its callback subtracting the bytes when the storage dies; storage resizes, FSDP2's way of freeing an
unsharded parameter, patched in as MemTracker does) and raises torch.OutOfMemoryError, the GPU's
error, when an op's new storages take it past the cap. The op has already run by then: the cap
judges what tensors hold, not the allocator's calls, and the step fails at the same op it would fail
at on a device with that much memory.

Counted: every CPU storage an op in this rank's thread creates once the cap is on (the model, its
gradients, optimizer state, activations, temporaries, communication buffers torch allocates).
Not counted: tensors made outside the dispatcher (a numpy array's memory, a mapped checkpoint file),
a mapped file registered in trainee.ON_DISK (offload=nvme's moments) and its views, or tensors made on another thread (gloo's workers, an asynchronous save's stager), the same blind spots
MemTracker has.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from trainer.private_apis.of_torch import TorchDispatchMode, storage_key, tensor_storages, tree_leaves
from trainer.rank.trainee import ON_DISK
from trainer.units import GIB

_ACTIVE: list[TensorCap] = []  # the cap of this rank, while it is on


class TensorCap(TorchDispatchMode):
    """A running total of live CPU tensor bytes, refusing past `cap` bytes."""

    def __init__(self, cap: int) -> None:
        from torch.distributed.tensor import (
            DTensor,
        )  # here: the job process imports this module, never DTensor

        super().__init__()
        self._dtensor = DTensor
        self.cap = cap
        self.held = 0
        """Bytes the live storages hold now."""
        self.peak = 0
        self._sizes: dict[int, int] = {}  # StorageImpl address -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._resize: Any = None
        self._refused: tuple[int, int] | None = None  # (held, the refused op's bytes) when it refused

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._dtensor in types:
            return NotImplemented  # DTensor desugars into its local ops first, which come back here
        out = func(*args, **(kwargs or {}))
        held = self.held
        grown = self._count_outputs(out)
        if grown > 0 and self.held > self.cap:
            del out  # not kept alive by the error's traceback: a refused op's output is not held
            self._refuse(grown, held=held)
        return out

    def _count_outputs(self, out: Any) -> int:
        """Count the new storages among an op's outputs; the bytes they add."""
        before = self.held
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                # A fake tensor's storage (DTensor's sharding propagation, compile's tracing) is on meta.
                for storage in tensor_storages(leaf):
                    if storage.device.type == "cpu":
                        self._count(storage)
        return self.held - before

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage_key(storage)
        if key in self._sizes or storage.data_ptr() in ON_DISK:
            return
        self._sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._forget(key))
        self._grow(self._sizes[key])

    def _forget(self, key: int) -> None:
        self.held -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _grow(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def resized(self, storage: torch.UntypedStorage, size: int) -> None:
        """UntypedStorage.resize_ is not an op the dispatcher sees (FSDP2 frees and refills its
        unsharded parameters with it), so it is wrapped while the cap is on, as MemTracker does."""
        self._resize(storage, size)
        key = storage_key(storage)
        if key in self._sizes and self._sizes[key] != storage.nbytes():
            grown = storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
            self._grow(grown)
            if grown > 0 and self.held > self.cap:
                self._refuse(grown, held=self.held - grown)

    def _refuse(self, nbytes: int, held: int) -> None:
        self._refused = (held, nbytes)
        raise torch.OutOfMemoryError(
            f"CPU out of memory under device_memory_gib: tried to allocate {nbytes} bytes while tensors held "
            f"{held} bytes ({held / GIB:.4f} GiB) of the cap's {self.cap} bytes ({self.cap / GIB:.4f} GiB)"
        )

    def __enter__(self) -> TensorCap:
        self._resize = torch.UntypedStorage.resize_
        cap = self

        def resize_(storage: torch.UntypedStorage, size: int) -> None:
            cap.resized(storage, size)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        _ACTIVE.remove(self)
        super().__exit__(*exc)

    def at_failure(self) -> dict[str, float]:
        """The failure record's figures: what tensors held (before the refused op's storages, if it
        was the cap that refused), the cap, and the refused bytes."""
        held, refused = self._refused or (self.held, 0)
        return {"held": float(held), "cap": float(self.cap), "refused": float(refused)}


def active_cap() -> TensorCap | None:
    """This rank's CPU cap while it is on."""
    return _ACTIVE[-1] if _ACTIVE else None
