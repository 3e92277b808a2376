"""What a training step measures: activation bytes saved for backward, and the metrics file."""
from __future__ import annotations

import itertools
import json
import os
import weakref
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (its StorageImpl's address): views share it, and it
    is unique among live storages, real or fake (a fake tensor's data_ptr is 0 for all)."""
    return tensor.untyped_storage()._cdata


class _Saved:
    """What autograd keeps for one saved tensor while the meter watches: the tensor, detached.
    Autograd drops it once backward has used it; the meter learns that from its finalizer."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Counts the bytes autograd keeps for backward, through saved-tensor hooks: ``live`` now,
    and ``peak``, the most alive at once since it was last reset.

    A storage is counted while some saved tensor refers to it (views of one tensor share it,
    a buffer saved by several micro-batches counts once) and released when autograd frees the
    last of them, after the backward that used it. So the peak is what the schedule keeps in
    flight: one micro-batch's forward for plain gradient accumulation, up to the pipeline
    depth on the first stage of 1F1B, and under zero-bubble until the weight-gradient pass.
    Parameters and buffers are left out: they are model state. With recomputation, checkpointed regions
    save only their inputs, which is exactly what this sees.
    """

    def __init__(self, parameter_storages: Callable[[], set[int]]):
        self.parameter_storages = parameter_storages  # asked per forward: ZeRO-3 gathers move them
        self._params: set[int] = set()
        self._holders: dict[int, int] = {}  # storage → saved tensors referring to it
        self.live = 0
        self.peak = 0

    @classmethod
    def for_module(cls, module: torch.nn.Module) -> "ActivationMeter":
        return cls(lambda: {storage_key(p) for p in itertools.chain(module.parameters(), module.buffers())})

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()  # storage_key
        if key in self._params or nbytes == 0:
            return tensor
        if key not in self._holders:
            self._holders[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._holders[key] += 1
        # Detached: a saved output holding its own grad_fn would tie the graph in a cycle through
        # C++ that never frees when backward keeps the graph (zero-bubble's B step does).
        saved = _Saved(tensor.detach())
        weakref.finalize(saved, self._release, key, nbytes)
        return saved

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int, nbytes: int) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.live -= nbytes

    def forward_pass(self):
        """Context for one micro-batch's forward pass."""
        self._params = self.parameter_storages()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class LiveTensorMeter(TorchDispatchMode):
    """Counts the bytes of every tensor storage alive while it is active: ``live`` now, and
    ``peak``, the most at once since it was last reset. What a device's allocator would hold
    without its rounding and caching: model state, saved activations and every temporary.

    A storage counts once (views share it) from when an operator creates it, or from the start
    for the ``existing`` tensors, until it is freed. ``resizable`` tensors' storages change size
    without an operator (ZeRO-3 frees and regathers its full buffers): their sizes are read
    again at each operator, before the peak is taken."""

    def __init__(self, existing: Iterable[torch.Tensor] = (), resizable: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.resizable = list(resizable)
        self._bytes: dict[int, int] = {}  # storage key → bytes counted for it
        self.live = 0
        self.trace: list[int] | None = None  # a list: ``live`` after each operator, appended
        for tensor in existing:
            self._count(tensor)
        self.peak = self.live

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata  # storage_key
        if key in self._bytes:
            return
        self._bytes[key] = storage.nbytes()
        self.live += self._bytes[key]
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._bytes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in self.resizable:
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._bytes:
                self.live += storage.nbytes() - self._bytes[key]
                self._bytes[key] = storage.nbytes()
            else:
                self._count(tensor)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        self.peak = max(self.peak, self.live)
        if self.trace is not None:
            self.trace.append(self.live)
        return out


# The groups whose bulk traffic has a balanced counterpart in the planner: (axes, ledger keys of
# that traffic on the group's key). Not pp: its stages wait for different things (the bubble).
# Last, hybrid sharding's all-reduce between its groups ("dpr", keyed "dp"): a group of its own
# only beside cp, where the gradients' key is "dp+cp" (without cp "dp" already holds it).
EXPOSED_GROUPS = ((("dp", "cp"), ("",)), (("tp",), ("", ".loss", ".partial_grads")), (("cp",), ("",)), (("dpr",), ("",)))


def least_exposed(comm, calls: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per group of ``EXPOSED_GROUPS`` with more than one rank, keyed like the ledger ("dp",
    "dp+cp", "tp", "cp"), two figures of the seconds its ranks were blocked on the group's traffic
    this step (``calls``: this rank's ``CommLedger.take_step_calls()`` lists, each call's wait):

    - the least of the ranks' step totals;
    - call by call, the least any rank waited, summed over the step's calls.

    A rank that reaches a collective first also waits for its slowest partner; the last to
    arrive waits only for the transfer itself, which is what a model of balanced ranks predicts.
    When the rank that arrives first changes from call to call (two ranks whose compute between
    blocking calls varies by ±10%), every rank's total holds about half of that skew, and only
    the call-by-call least is the transfers alone. Two MIN all-reduces per group, tagged
    ``"metrics"``: (calls, −calls, total), then the calls' waits, left out (on every rank alike)
    where the ranks counted different calls. Every rank must call it."""
    import torch.distributed as dist

    totals: dict[str, float] = {}
    per_call: dict[str, float] = {}
    for axes, suffixes in EXPOSED_GROUPS:
        key = comm.mesh.label(*axes)
        if comm.mesh.size(*axes) == 1 or key in totals:
            continue
        mine = [wait for suffix in suffixes for wait in calls.get(key + suffix, [])]
        summary = torch.tensor([len(mine), -len(mine), sum(mine)], dtype=torch.float64,
                               device=comm.mesh.device)  # NCCL reduces device tensors only
        comm.all_reduce(summary, axes, op=dist.ReduceOp.MIN, tag="metrics")
        totals[key] = summary[2].item()
        if mine and summary[0].item() == -summary[1].item():
            waits = torch.tensor(mine, dtype=torch.float64, device=comm.mesh.device)
            comm.all_reduce(waits, axes, op=dist.ReduceOp.MIN, tag="metrics")
            per_call[key] = waits.sum().item()
    return totals, per_call


class MetricsWriter:
    """One JSON object per line; the file is rewritten from the start of a fresh run. A run
    resumed at ``resume_step`` keeps the records up to that step and drops the later ones, which
    the resumed run writes again (the steps after the checkpoint, before a failure or a stop)."""

    def __init__(self, path: str | Path | None, resume_step: int = 0):
        self.file = None
        if path:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step and path.is_file():  # written beside and moved over it: a crash here loses nothing
                kept = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                with open(path) as old, open(kept, "w") as new:
                    new.writelines(_records_up_to(old, resume_step))
                os.replace(kept, path)
            self.file = open(path, "a" if resume_step else "w", buffering=1)

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()


def _records_up_to(lines, step: int):
    """The records of a metrics file whose step is at most ``step``, each ending its line; a line
    that is not a record (one a killed run left half written) is dropped."""
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and not (isinstance(record.get("step"), int) and record["step"] > step):
            yield line if line.endswith("\n") else line + "\n"
