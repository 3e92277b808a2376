"""DCP, the one place threefold touches it: each rank writes and reads its own pieces of full
tensors (``Shard``s) with two small planners, and the metadata lists what a checkpoint holds.

Kept apart from ``checkpoint.py`` so that importing DCP (and the DTensor stack under it, a
second of CPU per process by ``python -X importtime``) waits until a run first saves or loads;
a run that never does, never pays it. (In the 8-rank demo the difference is within the
run-to-run noise of its start: 30.0-32.0 s against 31.2-31.7 s for three steps.)
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


from threefold.parallel.placements import Shard

__all__ = ["CheckpointException", "MetadataIndex", "TensorStorageMetadata", "load_pieces", "read_metadata",
           "save_pieces"]


class _SavePieces(DefaultSavePlanner):
    """Each rank writes its pieces; the default global plan drops the duplicates of replicated
    pieces and checks that the pieces of every tensor cover it exactly once."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        # a piece once, though a rank may hold two equal copies (both ends of tied embeddings under DualPipeV)
        unique = {(s.name, s.offsets): s for shards in self.state_dict.values() for s in shards}
        self.pieces = {at: s.tensor for at, s in unique.items()}
        items = [WriteItem(index=MetadataIndex(s.name, s.offsets), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=s.tensor.shape),
                               properties=TensorProperties.create_from_tensor(s.tensor),
                               size=torch.Size(s.full_shape)))
                 for s in unique.values()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))]


class _LoadPieces(LoadPlanner):
    """Each rank reads, into each of its pieces, the overlapping parts of the saved pieces."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata = state_dict, metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for name, shards in self.state_dict.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=s.tensor.shape) for s in shards]
            items += create_read_items_for_chunk_list(name, self.metadata.state_dict_metadata[name], chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise AssertionError("threefold checkpoints hold tensors only")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        target = self.state_dict[read_item.dest_index.fqn][read_item.dest_index.index].tensor
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor gave a view: the data is already in place


def save_pieces(folder, named: dict[str, list[Shard]], no_dist: bool, group=None) -> None:
    """Write every rank's pieces ``named`` (tensor name → this rank's pieces) into ``folder``."""
    dcp.save(named, storage_writer=FileSystemWriter(folder), planner=_SavePieces(), process_group=group,
             no_dist=no_dist)


def load_pieces(path, named: dict[str, list[Shard]], no_dist: bool) -> None:
    """Fill every piece in ``named`` with the overlapping parts of the pieces saved at ``path``."""
    dcp.load(named, storage_reader=FileSystemReader(path), planner=_LoadPieces(), no_dist=no_dist)


def read_metadata(path):
    """DCP's metadata of the checkpoint at ``path``: every tensor's chunks and the files holding them."""
    return FileSystemReader(path).read_metadata()
