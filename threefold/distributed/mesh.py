"""ParallelMesh: the ranks of a job arranged on named axes, with one process group per axis.

The world is a grid of ranks, ``grid = arange(world).view(pp, edp, epd, cp, tp)``: tensor
parallelism is the innermost axis (neighbouring ranks, which share the fastest links, usually
one node's NVLink), pipeline parallelism the outermost (it sends the least, so it can cross
nodes). This is Megatron-LM's order tp-cp-ep-dp-pp; a rank's coordinates are where it sits
in the grid, as in picotron.

Expert parallelism is carved out of the data-parallel ranks, as torchtitan does: the dp ranks
of a replica's position are ``edp × epd`` (edp = dp/ep, epd = ep the inner one). ``"dp"`` keeps
its meaning, all data-parallel ranks (the group spanning edp and epd, coordinate edp·ep + ep);
``"ep"`` is the group that splits the experts (each holds E/ep of them and the tokens are
exchanged there); ``"edp"`` the expert-data-parallel group, the ranks holding the same experts,
over which expert gradients are reduced. With ep=1, edp is dp. The world is dp·tp·pp·cp.

Folded experts (``expert_tp=1``, Megatron-Core's ``--expert-tensor-parallel-size 1``, torchtitan's
``etp=1``): the ep group is ``ep`` consecutive ranks of a stage, the tp and cp ranks inside it and
ep/(tp·cp) dp ranks: grid dimension ``epd`` is then ep/(tp·cp), and ``"ep"`` spans epd, cp and
tp. The experts are split over tp and cp ranks too instead of repeated on them, and edp, the
ranks holding the same experts, is dp·tp·cp/ep.

Hybrid sharding (HSDP) splits the dp ranks once more, ``dp = dpr × dps × epd`` (dps inside dpr):
ZeRO-3 shards the dense weights over a group of dps·ep consecutive dp ranks (the config's
dp_shard) and the experts over its dps ranks that hold the same experts, and the "dpr" group
holds the same shards on each of its ranks. Without it dpr = 1, and dps is edp. So the grid is
``(pp, dpr, dps, epd, cp, tp)``, "edp" spans dpr and dps, and "dp" spans dpr, dps and epd.

Example, world 8 with dp=2, tp=2, pp=2: rank 5 sits at (pp=1, dp=0, tp=1); its tp group is
[4, 5], its dp group [5, 7], its pp group [1, 5]. With dp=4, ep=2 (world 4): rank 3 has dp
coordinate 3, ep group [2, 3], edp group [1, 3]. Folded, with dp=2, tp=2, ep=2 (world 4): rank 3's
ep group is its tp group [2, 3], its edp group [1, 3].

The mesh is an object that strategies receive; there is no global mesh. It also works with
world size 1 and no process group at all: every axis has size 1 and no group. Coordinates and
group rows are plain arithmetic, computed when first asked; process groups are made once, at
construction (``new_group`` is collective), one per distinct set of ranks.
"""
from __future__ import annotations

import datetime
import math
import os

import numpy as np
import torch
import torch.distributed as dist

from threefold.config import ConfigError, ParallelConfig
from threefold.words import plural

AXES = ("pp", "dp", "ep", "cp", "tp")  # the config's axes, outermost first
GRID = ("pp", "dpr", "dps", "epd", "cp", "tp")  # the grid's dimensions in this order: dp is dpr × dps × epd
# axes that span several grid dimensions (or another one's name): "ep" is epd, folded epd × cp × tp
SPANS = {"dp": ("dpr", "dps", "epd"), "edp": ("dpr", "dps"), "ep": ("epd",)}
FOLDED_EP = ("epd", "cp", "tp")
DP_PARTS = ("edp", "dpr", "dps")  # groups of data-parallel ranks: their traffic counts as dp's
# Groups over several axes created by default: weight gradients of a context-parallel model
# are reduced over dp × cp (its experts' over edp × cp); hybrid sharding's shards over dps (× ep)
# (× cp); and dp × tp. A set whose axes of size > 1 name an existing group adds none.
COMBINED = (("dp", "cp"), ("edp", "cp"), ("dps", "cp"), ("dps", "ep"), ("dps", "ep", "cp"), ("dp", "tp"))
# and with folded experts: the tp and cp ranks that route shares of one micro-batch, and the
# ranks of a stage (the step's routing counters are summed over them)
FOLDED = (("cp", "tp"), ("dp", "cp", "tp"))


def mesh_sizes(parallel: ParallelConfig) -> dict[str, int]:
    """The sizes a config gives the mesh: its axes, and hybrid sharding's groups ("dpr")."""
    return {axis: getattr(parallel, axis) for axis in AXES} | {"dpr": parallel.dp_replicate}


def grid_axes(axes, spans: dict = SPANS) -> tuple[str, ...]:
    """The grid dimensions a set of axes spans, in the grid's order ("dp" → dpr, dps, epd)."""
    spanned = {g for a in axes for g in spans.get(a, (a,))}
    return tuple(g for g in GRID if g in spanned)


class ParallelMesh:
    """This rank's place in the grid of ranks, and a process group for each axis (or set of axes)."""

    def __init__(self, sizes: dict[str, int], rank: int = 0, timeout_s: float = 300.0,
                 combined: tuple[tuple[str, ...], ...] = COMBINED,
                 device: torch.device | None = None, owns_process_group: bool = False, expert_tp: int = 0):
        """``sizes``: the config's axes, and "dpr", hybrid sharding's groups holding the same shards.
        ``expert_tp``: 1 folds the ep group over tp and cp (the module docstring), 0 carves it out of dp."""
        unknown = set(sizes) - set(AXES) - {"dpr"}
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {AXES} and dpr")
        given = {axis: int(sizes.get(axis, 1)) for axis in AXES + ("dpr",)}
        self.folded = expert_tp == 1 and given["ep"] > 1
        inside = given["tp"] * given["cp"] if self.folded else 1  # ep's ranks that are not dp ranks
        if given["ep"] % inside or given["dp"] % (given["ep"] // inside):
            raise ValueError(f"ep={given['ep']} must divide dp={given['dp']}: the experts are split over data-parallel "
                             "ranks" if not self.folded else
                             f"folded ep={given['ep']} must be tp·cp={inside} times a divisor of dp={given['dp']}")
        self.spans = dict(SPANS, ep=FOLDED_EP) if self.folded else SPANS
        self.dims = {"pp": given["pp"], "dpr": given["dpr"], "epd": given["ep"] // inside, "cp": given["cp"],
                     "tp": given["tp"]}  # the grid's dimensions
        edp = given["dp"] // self.dims["epd"]
        if edp % given["dpr"]:
            raise ValueError(f"dpr={given['dpr']} must divide dp/ep={edp}: hybrid sharding "
                             "splits the data-parallel ranks into groups of whole ep groups")
        self.dims["dps"] = edp // given["dpr"]
        self.dims = {a: self.dims[a] for a in GRID}
        # the size of every axis and grid dimension a strategy may name
        self.sizes = {a: math.prod(self.dims[g] for g in grid_axes((a,), self.spans))
                      for a in AXES + ("edp", "dpr", "dps", "epd")}
        # numpy, not torch: the grid is bookkeeping, and stays plain integers under a FakeTensorMode
        self.grid = np.arange(self.world_size).reshape(*self.dims.values())
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        self.rank = rank
        self.grid_coords = dict(zip(GRID, np.argwhere(self.grid == rank)[0].tolist()))
        self.coords = {a: self.coord(a) for a in ("pp", "dp", "edp", "dpr", "dps", "ep", "cp", "tp")}
        self._rows: dict[tuple[str, ...], list[list[int]]] = {}
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device or torch.device("cpu")
        self.owns_process_group = owns_process_group
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._created: list[dist.ProcessGroup] = []
        if self.world_size > 1 and dist.is_initialized():  # without a process group: coordinates only
            # new_group is collective: every rank creates every group, in the same order.
            if self.folded:  # hybrid sharding's groups with ep (refused when folded) would be whole stages
                combined = tuple(c for c in combined if "ep" not in c) + FOLDED
            for axes in [(axis,) for axis in AXES + ("edp", "dpr", "dps", "epd")] + [tuple(c) for c in combined]:
                self._create(axes)

    # --- construction from a config, inside or outside torchrun ---------------------------
    @classmethod
    def from_config(cls, parallel: ParallelConfig) -> "ParallelMesh":
        """The mesh of this process: joins the job's process group (creating it under torchrun)
        and checks that the number of processes equals dp·tp·pp·cp."""
        owns = False
        device = None
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # NCCL between GPUs, gloo between CPU processes; torchrun's env:// rendezvous.
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(device)
            setup = _setup_timeout(parallel.timeout_s)
            dist.init_process_group(backend, timeout=setup, **_restart_store(setup))
            _bound_collectives(dist.group.WORLD, datetime.timedelta(seconds=parallel.timeout_s))
            owns = True
        elif dist.is_initialized() and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != parallel.world_size:
            p = parallel
            raise ConfigError(f"parallel: the layout dp×tp×pp×cp = {p.dp}×{p.tp}×{p.pp}×{p.cp} = "
                              f"{plural(p.world_size, 'rank')}, but {plural(world, 'process')} "
                              f"{'is' if world == 1 else 'are'} running")
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(mesh_sizes(parallel), rank, parallel.timeout_s, device=device, owns_process_group=owns,
                   expert_tp=parallel.expert_tp)

    # --- what a strategy asks ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return math.prod(self.dims.values())

    def size(self, *axes: str) -> int:
        """Ranks in the group spanned by ``axes`` (1 for no axes)."""
        return math.prod(self.dims[a] for a in self._ordered(axes))

    def coord(self, *axes: str) -> int:
        """This rank's index inside the group spanned by ``axes`` (outer axes major, as in the grid)."""
        index = 0
        for axis in self._ordered(axes):
            index = index * self.dims[axis] + self.grid_coords[axis]
        return index

    def ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group along ``axes``, ordered by ``coord``."""
        return next(row for row in self._group_rows(self._ordered(axes)) if self.rank in row)

    def group(self, *axes: str) -> dist.ProcessGroup | None:
        """The process group along ``axes``; None when the group is this rank alone."""
        key = self._key(axes)
        if not key:
            return None
        if key not in self._groups:
            raise KeyError(f"no process group was created for axes {key}; pass it to ParallelMesh(combined=...)")
        return self._groups[key]

    def label(self, *axes: str) -> str:
        """The key the ledger counts a group's traffic under: the axes as named, those of size 1
        left out, joined in the grid's order ("dp+cp"), or the axes as given when all have size
        1. The grid's epd counts as "ep". The expert-data-parallel group counts as "dp", even of one rank (ep = dp): its traffic
        is data-parallel gradient and parameter traffic, as dp's is (with ep=1 it is the dp
        group), so the experts' edp × cp counts under "dp+cp", with the dense gradients' dp × cp;
        so do hybrid sharding's dps and dpr groups, and its dense shard group dps × ep (ep ranks
        are dp ranks to the dense weights). Without data parallelism (dp = 1) there is no "dp":
        the experts' edp × cp is the cp group, as the dense gradients' is."""
        sizes: dict[str, int] = {}
        part = any(a in DP_PARTS for a in axes) and self.size("dp") > 1
        for a in axes:  # the grid's epd is the ep group's (where it is not dp's)
            named_as = "dp" if a in DP_PARTS or (part and a in ("ep", "epd")) else "ep" if a == "epd" else a
            sizes[named_as] = sizes.get(named_as, 1) * self.size(a)
        named = [a for a in AXES if a in sizes]
        return "+".join([a for a in named if sizes[a] > 1 or (a == "dp" and part)] or named)

    def shutdown(self) -> None:
        """Destroy the groups this mesh created, and the job's group if the mesh started it."""
        if not dist.is_initialized():
            return
        for group in self._created:
            dist.destroy_process_group(group)
        self._created.clear()
        self._groups.clear()
        if self.owns_process_group:
            dist.destroy_process_group()
            self.owns_process_group = False

    def __repr__(self) -> str:
        shape = " ".join(f"{a}={self.sizes[a]}" for a in AXES if self.sizes[a] > 1) or "single"
        shape += f" (ep folded over {', '.join(a for a in ('tp', 'cp') if self.dims[a] > 1) or 'dp'})" if self.folded else ""
        where = " ".join(f"{a}={self.coords[a]}" for a in AXES if self.sizes[a] > 1)
        return f"ParallelMesh({shape}; rank {self.rank}{': ' + where if where else ''})"

    # --- internals --------------------------------------------------------------------------
    def _ordered(self, axes) -> tuple[str, ...]:
        """The grid dimensions ``axes`` span, in the grid's order."""
        for axis in axes:
            if axis not in self.sizes:
                raise KeyError(f"unknown mesh axis {axis!r}; the axes are {AXES}, edp, dpr, dps and epd")
        return grid_axes(axes, self.spans)

    def _key(self, axes) -> tuple[str, ...]:
        """Axes of size 1 change nothing about a group: ("dp", "cp") with cp=1 is the dp group."""
        return tuple(a for a in self._ordered(axes) if self.dims[a] > 1)

    def _group_rows(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group along grid dimensions ``axes``: move those last and read the grid row by
        row (kept: every collective asks, and a world of thousands has thousands of rows)."""
        if axes not in self._rows:
            rest = [GRID.index(a) for a in GRID if a not in axes]
            along = [GRID.index(a) for a in axes]
            self._rows[axes] = self.grid.transpose(*rest, *along).reshape(-1, self.size(*axes)).tolist()
        return self._rows[axes]

    def _create(self, axes: tuple[str, ...]) -> None:
        key = self._key(axes)
        if not key or key in self._groups:
            return
        if self.size(*key) == self.world_size and self.owns_process_group:
            self._groups[key] = dist.group.WORLD  # same members, same timeout: no need for another
            return
        for row in self._group_rows(key):
            group = dist.new_group(row, timeout=_setup_timeout(self.timeout.total_seconds()))
            self._created.append(group)
            if self.rank in row:
                _bound_collectives(group, self.timeout)
                self._groups[key] = group


# Joining a group waits for every member to arrive and connect; on a loaded machine one rank can
# start seconds after another (importing torch alone), so a short parallel.timeout_s, which
# bounds each collective, would fail the job before its first step. Joins get at least this long.
SETUP_TIMEOUT_S = 120.0


def _setup_timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout_s, SETUP_TIMEOUT_S))


def _bound_collectives(group, timeout: datetime.timedelta) -> None:
    """Each collective of ``group`` fails after ``timeout`` (gloo and NCCL; the dry run's fake
    process group has no timeout to set)."""
    if dist.get_backend(group) in ("gloo", "nccl"):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _restart_store(timeout: datetime.timedelta) -> dict:
    """After torchrun restarts failed workers, a store namespace of their own for this attempt.

    torchrun keeps one rendezvous store across restarts, so the addresses the dead attempt's
    ranks published are still there; read by the new attempt, they point at closed ports. On a
    restart each attempt therefore joins under its own prefix. The first attempt uses env://.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not attempt:
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    return {"store": dist.PrefixStore(f"threefold/attempt{attempt}/", store), "rank": rank, "world_size": world}
