"""Split the plain model into the stage modules of one pipeline rank.

``partition`` (partition.py) says which blocks each stage runs; stage ``s`` lives on pipeline
rank ``schedule.rank_of(s)``. A ``StageModule`` holds the plain model's own modules for its
stage (so its parameter names are the plain model's state-dict keys) and runs them with the
model's own block loop, ``Llama.run_blocks``: the embedding on the first stage (called by the
runtime, which needs the embedded input for a split backward), blocks ``span.blocks``, and the
final norm and head on the last. Nothing else of the model stays referenced, so a rank keeps
only its stages' tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from threefold.models.llama import Llama
from threefold.parallel.pipeline.partition import StageSpan


class StageModule(nn.Module):
    """The part of the plain model one stage runs (see the module docstring)."""

    def __init__(self, model: Llama, span: StageSpan):
        super().__init__()
        self.span = span
        self.first, self.last = span.first, span.last
        self.embed = model.embed if span.first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in span.blocks})
        self.norm = model.norm if span.last else None
        self.head = model.head if span.last else None
        self.rope_cos, self.rope_sin = model.rope_cos, model.rope_sin

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor | range) -> torch.Tensor:
        """The next stage's input, or on the last stage the logits. ``positions``: the tokens'
        positions in the sequence, for the rotary tables (this rank's under context parallelism;
        the hidden state holds fewer of them under sequence parallelism)."""
        hidden = Llama.run_blocks(self, hidden, positions, self.blocks.values())
        if self.last:
            return self.head(self.norm(hidden))
        return hidden


def stage_modules(model: Llama, spans: list[StageSpan], stages) -> dict[int, StageModule]:
    """This rank's stages (index → module) of the plain ``model``, cut at ``spans``."""
    return {s: StageModule(model, spans[s]) for s in stages}
