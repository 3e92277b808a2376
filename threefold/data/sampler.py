"""Which token windows make up each batch: a pure function of (seed, step), whatever the layout.

The training tokens are cut into ``n`` non-overlapping windows of ``seq_len + 1`` tokens (inputs
and the targets shifted by one share all but one token). Sample ``k`` of the run, counted over
all steps (``k = step · global_batch + row``), lies in epoch ``k // n`` at position ``k % n``.
Each epoch visits every window once, in an order drawn from ``(seed, epoch)``, and shifts all
windows by an offset drawn from the same generator, so successive epochs cut the text at
different places. ``n`` leaves one window's worth of slack for that offset, so the offset can
take every value in ``[0, seq_len)`` once the corpus holds two windows.

Since a batch is computed from its sample numbers alone, rank ``r`` of ``world`` reads only its
own rows, any number of processes see the same global batch, and the state is just the step.
"""
from __future__ import annotations

import numpy as np
import torch

from threefold.config import ConfigError
from threefold.words import plural


class BatchSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1 or global_batch < 1:
            raise ConfigError(f"sampler: seq_len and global_batch must be positive, got {seq_len} and {global_batch}")
        if seed < 0:
            raise ConfigError(f"train.seed: must not be negative, got {seed}")
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"data.corpus: {plural(len(tokens), 'training token')}, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.step = 0  # the next step next_batch() returns
        self.windows = max(1, (len(tokens) - seq_len) // seq_len)
        self.max_offset = len(tokens) - 1 - self.windows * seq_len
        self._epoch_cache: dict[int, tuple[int, np.ndarray]] = {}

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 tensors of shape (global_batch, seq_len)."""
        return self._rows(step, 0, self.global_batch)

    def local_batch_at(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [rank·B/world, (rank+1)·B/world) of the global batch of ``step``, computed alone."""
        if world < 1 or self.global_batch % world:
            raise ConfigError(f"train.global_batch: {self.global_batch} is not divisible by {world} data-parallel ranks")
        if not 0 <= rank < world:
            raise ConfigError(f"sampler: rank {rank} is outside a world of {world}")
        rows = self.global_batch // world
        return self._rows(step, rank * rows, rows)

    def next_batch(self, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the batch at ``self.step``; advances the step."""
        batch = self.local_batch_at(self.step, rank, world)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step, "seq_len": self.seq_len, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if missing := [key for key in self.state_dict() if key not in state]:
            raise ConfigError(f"sampler state: the checkpoint holds no {', '.join(missing)} (it was not saved by "
                              f"train), so a run cannot resume from it")
        for key in ("seed", "seq_len", "global_batch"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler state: saved with {key}={state[key]}, but this run has {key}={getattr(self, key)}")
        self.step = int(state["step"])

    def _rows(self, step: int, first_row: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step < 0:
            raise ConfigError(f"sampler: step must not be negative, got {step}")
        samples = step * self.global_batch + first_row + np.arange(rows, dtype=np.int64)
        starts = np.empty(rows, dtype=np.int64)
        epochs = samples // self.windows
        for epoch in np.unique(epochs):  # a batch spans at most a few epochs
            offset, order = self._epoch(int(epoch))
            in_epoch = epochs == epoch
            starts[in_epoch] = offset + order[samples[in_epoch] % self.windows] * self.seq_len
        return _windows(self.tokens, starts, self.seq_len)

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        """The offset and window order of an epoch; the last two are kept (a batch can straddle two)."""
        if epoch not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(0, self.max_offset + 1))
            self._epoch_cache[epoch] = (offset, rng.permutation(self.windows))
            for old in sorted(self._epoch_cache)[:-2]:
                del self._epoch_cache[old]
        return self._epoch_cache[epoch]


def validation_windows(tokens: np.ndarray, seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``count`` fixed windows whose starts are spread evenly over the
    validation split: they depend on the split, ``seq_len`` and ``count`` alone, never on the layout."""
    if len(tokens) < seq_len + 1:
        raise ConfigError(f"data.corpus: {plural(len(tokens), 'validation token')}, fewer than seq_len + 1 = {seq_len + 1}")
    starts = np.linspace(0, len(tokens) - seq_len - 1, count).round().astype(np.int64)
    return _windows(tokens, starts, seq_len)


def val_batches(tokens: np.ndarray, seq_len: int, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``batch · count`` validation windows in ``count`` batches of ``batch``."""
    inputs, targets = validation_windows(tokens, seq_len, batch * count)
    return list(zip(inputs.split(batch), targets.split(batch)))


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    windows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())
