"""What a training step measures: activation bytes saved for backward, and the metrics file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch


class ActivationMeter:
    """Counts the bytes autograd saves for backward, through saved-tensor hooks.

    Each distinct storage is counted once (views of one tensor share it) and parameters are
    left out: they are model state, not activations. With recomputation, checkpointed
    regions save only their inputs, which is exactly what this sees. ``peak`` is the largest
    amount saved by one forward pass (micro-batches run one after another, so their
    activations are never alive together).
    """

    def __init__(self, parameter_storages: Callable[[], set[int]]):
        self.parameter_storages = parameter_storages  # asked per forward: ZeRO-3 gathers move them
        self._params: set[int] = set()
        self.peak = 0
        self._seen: set[int] = set()
        self._current = 0

    @classmethod
    def for_module(cls, module: torch.nn.Module) -> "ActivationMeter":
        return cls(lambda: {p.untyped_storage().data_ptr() for p in module.parameters()})

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen and key not in self._params and storage.nbytes() > 0:
            self._seen.add(key)
            self._current += storage.nbytes()
            self.peak = max(self.peak, self._current)
        return tensor

    def forward_pass(self):
        """Context for one micro-batch's forward pass."""
        self._seen.clear()
        self._current = 0
        self._params = self.parameter_storages()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


class MetricsWriter:
    """One JSON object per line; the file is rewritten from the start of a fresh run."""

    def __init__(self, path: str | Path | None, append: bool = False):
        self.file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a" if append else "w", buffering=1)

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()
