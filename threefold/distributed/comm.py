"""Every collective and point-to-point operation of the engine goes through here, and is counted.

``Comm`` binds a mesh to a ``CommLedger``: ``comm.all_reduce(t, "dp")`` runs over the mesh's dp
group and records the operation, the axis, the bytes this rank sent, and the time it took.

Every operation takes one axis name or a tuple of axes: ``comm.all_reduce(t, ("dp", "cp"))``
runs over the group spanning both (the mesh creates it, see ``ParallelMesh(combined=...)``),
with ranks ordered by ``mesh.coord(*axes)``, and is counted under the joined key ``"dp+cp"``
(axes in the mesh's order). Axes of size 1 drop out of the key, so with cp=1 the same call is
counted under ``"dp"``, exactly as ``comm.all_reduce(t, "dp")``.

Bytes follow the ring convention of nccl-tests ("bus bytes"), the traffic one rank puts on
its link when the collective runs as a ring over n ranks, for a tensor of B bytes:

    all-reduce        2(n−1)/n · B      (a reduce-scatter followed by an all-gather)
    reduce-scatter     (n−1)/n · B      (B is the full input; each rank keeps B/n)
    all-gather         (n−1)/n · B      (B is the full output)
    all-to-all         (n−1)/n · B      (B is this rank's input; with uneven splits, exactly the
                                        bytes of the splits it sends to the other ranks, its own
                                        split excluded)
    broadcast                  B        (on every rank of the group, the source included:
                                        nccl-tests' bus factor 1, a pipelined ring in which each
                                        rank forwards the whole tensor once)
    send                       B        (a point-to-point send; its receive counts 0)

These are the numbers the planner's formulas use (threefold/plan/costs.py), whatever
algorithm the backend picks underneath.

Tags keep small bookkeeping traffic apart from the bulk: the loss averaged for the log and the
squared gradient norm are one scalar each, tagged ``"scalar"`` and reported under the key
``"dp.scalar"``; gathers done to save a checkpoint (``"checkpoint"``) or to evaluate
(``"eval"``) likewise. Untagged traffic is reported under the bare axis name, so ``"dp"`` holds
exactly the gradient and parameter traffic that ``dp_bytes_per_step`` predicts. Nothing is
hidden: every byte appears under some key.

Time: a synchronous call records its duration. An asynchronous call returns a ``Pending``
handle; ``seconds`` is the time from launch to completion, taken from the work's future so a
late ``wait()`` does not inflate it (gloo's reduce-scatter offers no future: there it is
launch to the return of ``wait()``, an upper bound), and ``waited`` the time the caller was
blocked in ``wait()``, the part of the communication that compute did not hide.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor  # a dry run's tensors

from threefold.distributed.mesh import ParallelMesh
from threefold.words import agree, plural

ROLL_CALL_S = 5.0  # after a failed collective, how long survivors wait for each other to check in


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the operation, axis and rank."""


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


@dataclass
class CommRecord:
    op: str
    axis: str  # the axis, or the joined key of several ("dp+cp")
    tag: str | None
    bytes: float  # sent by this rank, ring convention
    started: float  # time.perf_counter() at launch
    group: tuple[int, ...] = ()  # the global ranks taking part
    sequence: int | str = 0  # how many operations this rank had issued over that group before this one
    # (or a label every rank gives alike: library_error)
    peer: int | None = None  # send, recv: the global rank at the other end
    seconds: float | None = None  # launch to completion; None while in flight
    waited: float = 0.0  # time the caller spent blocked on it

    @property
    def key(self) -> str:
        return self.axis if self.tag is None else f"{self.axis}.{self.tag}"


def ring_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for ``op`` on a tensor of ``nbytes`` over ``n`` ranks (see module docstring)."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
              "all_to_all": (n - 1) / n, "broadcast": 1.0, "send": 1.0, "recv": 0.0}
    return factor[op] * nbytes


class CommLedger:
    """The operations of this rank since the last ``take()``; thread-safe (completions arrive
    on the backend's threads)."""

    def __init__(self):
        self.records: list[CommRecord] = []
        self._lock = threading.Lock()

    def add(self, record: CommRecord) -> None:
        with self._lock:
            self.records.append(record)

    def take(self) -> dict[str, int]:
        """Bytes per key ("dp", "dp.scalar", …) since the last call, and forget those records."""
        return self.take_step()[0]

    def take_step(self) -> tuple[dict[str, int], dict[str, float]]:
        """Bytes per key since the last call, and the seconds this rank was blocked per key: in
        synchronous calls and in ``wait()``, the communication compute did not hide (the
        exposed time); forget those records. A wait after this call is not counted."""
        sent, blocked, _ = self.take_step_calls()
        return sent, blocked

    def take_step_calls(self) -> tuple[dict[str, int], dict[str, float], dict[str, list[float]]]:
        """``take_step``'s bytes and seconds blocked per key, and per key each call's seconds
        blocked in the order this rank issued them (every member of a group issues its calls in
        the same order, so the lists of a group's ranks line up call by call)."""
        with self._lock:
            records, self.records = self.records, []
        sent: dict[str, float] = {}
        calls: dict[str, list[float]] = {}
        for r in records:
            sent[r.key] = sent.get(r.key, 0.0) + r.bytes
            calls.setdefault(r.key, []).append(r.waited)
        return {k: round(v) for k, v in sent.items()}, {k: sum(v) for k, v in calls.items()}, calls


class Pending:
    """An asynchronous collective in flight. ``wait()`` blocks until it is done."""

    def __init__(self, work, record: CommRecord, comm: "Comm"):
        self.work, self.record, self._comm = work, record, comm
        if work is None:
            record.seconds = 0.0
            return
        try:
            work.get_future().add_done_callback(self._completed)
        except RuntimeError:  # gloo's reduce-scatter has no future: completion is seen at wait()
            pass

    def _completed(self, _future) -> None:
        self.record.seconds = time.perf_counter() - self.record.started

    def wait(self) -> None:
        if self.work is None:
            return
        began = time.perf_counter()
        try:
            self.work.wait()
        except RuntimeError as err:
            raise self._comm.error(self.record, err) from err
        self.record.waited += time.perf_counter() - began
        if self.record.seconds is None:  # the callback runs on another thread; it may lag wait()
            self.record.seconds = time.perf_counter() - self.record.started
        self.work = None


Axes = str | tuple[str, ...]  # one mesh axis, or several spanning one group


class Comm:
    """Collectives along the axes of one mesh, each recorded in ``ledger``. ``axis`` is one axis
    name or a tuple of them (see the module docstring); ``peer`` and ``src`` are coordinates in
    that group, ``mesh.coord(*axes)``."""

    def __init__(self, mesh: ParallelMesh, ledger: CommLedger | None = None):
        self.mesh = mesh
        self.ledger = ledger or CommLedger()
        self._issued: dict[tuple[int, ...], int] = {}  # operations issued per group, for CommRecord.sequence

    def all_reduce(self, tensor: torch.Tensor, axis: Axes, *, op=dist.ReduceOp.SUM, async_op: bool = False,
                   tag: str | None = None) -> Pending | None:
        """Reduce ``tensor`` in place over the group along ``axis``."""
        return self._run("all_reduce", axis, tag, _nbytes(tensor), async_op,
                         lambda group: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: Axes, *, async_op: bool = False,
                       tag: str | None = None) -> Pending | None:
        """Sum ``input`` over the group; this rank gets chunk ``coord(axis)`` of the sum in ``output``.

        ``output`` may be that chunk of ``input`` itself (in place)."""
        return self._run("reduce_scatter", axis, tag, _nbytes(input), async_op,
                         lambda group: dist.reduce_scatter_single(output, input, group=group, async_op=async_op),
                         alone=lambda: _copy(output, input))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: Axes, *, async_op: bool = False,
                   tag: str | None = None) -> Pending | None:
        """Concatenate every rank's ``input`` into ``output`` (flat, in ``coord(axis)`` order).

        ``input`` may be this rank's chunk of ``output`` itself (in place)."""
        return self._run("all_gather", axis, tag, _nbytes(output), async_op,
                         lambda group: dist.all_gather_single(output, input, group=group, async_op=async_op),
                         alone=lambda: _copy(output, input))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, axis: Axes, *,
                   output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                   async_op: bool = False, tag: str | None = None) -> Pending | None:
        """Rank i's ``input`` rows ``input_split_sizes[j]`` (along dim 0, in order) go to the rank
        at coordinate j, which receives them as its rows ``output_split_sizes[i]``. Without
        split sizes, every rank sends and receives equal shares. Counted as the bytes of the
        splits this rank sends to the other ranks (its own split stays)."""
        axes = _axes(axis)
        n, me = self.mesh.size(*axes), self.mesh.coord(*axes)
        for name, splits, tensor in (("input", input_split_sizes, input), ("output", output_split_sizes, output)):
            rows = tensor.shape[0] if tensor.dim() else 1
            if splits is not None and (len(splits) != n or sum(splits) != rows):
                raise ValueError(f"all_to_all over {self.mesh.label(*axes)!r}: {name}_split_sizes {list(splits)} "
                                 f"must have {plural(n, 'entry')} summing to the {name}'s {plural(rows, 'row')}")
        if input_split_sizes is None:
            sent = ring_bytes("all_to_all", _nbytes(input), n)
        else:
            row_bytes = _nbytes(input) // max(input.shape[0], 1)
            sent = float((sum(input_split_sizes) - input_split_sizes[me]) * row_bytes)
        return self._run("all_to_all", axis, tag, _nbytes(input), async_op,
                         lambda group: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                              group=group, async_op=async_op),
                         sent=sent, alone=lambda: _copy(output, input))

    def broadcast(self, tensor: torch.Tensor, axis: Axes, src: int, *, async_op: bool = False,
                  tag: str | None = None) -> Pending | None:
        """Copy the ``tensor`` of the rank at coordinate ``src`` into every rank's ``tensor``."""
        root = self.mesh.ranks(*_axes(axis))[src]
        return self._run("broadcast", axis, tag, _nbytes(tensor), async_op,
                         lambda group: dist.broadcast(tensor, src=root, group=group, async_op=async_op))

    def send(self, tensor: torch.Tensor, axis: Axes, peer: int, *, tag: str | None = None) -> Pending:
        """Start sending ``tensor`` to the rank at coordinate ``peer`` along ``axis``; never blocks.
        Between two ranks messages arrive in the order they were sent (one tag, as NCCL and gloo
        match them), so the receiver posts its ``recv`` calls in the same order. ``tensor`` must
        stay unchanged until ``wait()`` returns."""
        dst = self.mesh.ranks(*_axes(axis))[peer]
        return self._run("send", axis, tag, _nbytes(tensor), True,
                         lambda group: dist.isend(tensor, dst=dst, group=group), peer=dst)

    def recv(self, tensor: torch.Tensor, axis: Axes, peer: int, *, tag: str | None = None) -> Pending:
        """Start receiving into ``tensor`` from the rank at coordinate ``peer`` along ``axis``;
        ``wait()`` blocks until it has arrived. Counted as 0 bytes: the sender counts them."""
        src = self.mesh.ranks(*_axes(axis))[peer]
        return self._run("recv", axis, tag, _nbytes(tensor), True,
                         lambda group: dist.irecv(tensor, src=src, group=group), peer=src)

    def barrier(self) -> None:
        """Wait for every rank of the job."""
        if self.mesh.world_size == 1:
            return
        group = tuple(range(self.mesh.world_size))
        record = CommRecord("barrier", "world", None, 0.0, time.perf_counter(), group, self._issued.get(group, 0))
        self._issued[group] = record.sequence + 1
        try:
            dist.barrier()
        except RuntimeError as err:
            raise self.error(record, err) from err

    def library_error(self, what: str, err: Exception, label: str) -> CommError:
        """A CommError for collectives that a library runs over the whole job outside this module
        (DCP's gathers and scatters of a checkpoint's plan), naming the ranks that did not take
        part: ``label`` keys the roll call and must be the same on every rank (the step saved)."""
        record = CommRecord(what, "world", None, 0.0, time.perf_counter(), tuple(range(self.mesh.world_size)), label)
        return CommError(f"{what} failed on rank {self.mesh.rank} ({self.mesh!r}): {_first_line(err)}"
                         f"{self._who_is_missing(record)}")

    def error(self, record: CommRecord, err: Exception) -> CommError:
        return CommError(f"{record.op} of {record.bytes:.0f} bytes over mesh axis {record.axis!r} failed on rank "
                         f"{self.mesh.rank} ({self.mesh!r}): {_first_line(err)}{self._who_is_missing(record)}")

    def _who_is_missing(self, record: CommRecord) -> str:
        """Name the ranks that did not take part. A point-to-point operation has one peer. For a
        collective, the survivors hold a roll call in the job's store, under the operation's
        sequence number in its group (every member issues the same sequence): each checks in,
        then waits a few seconds for the others; whoever never checks in is lost."""
        if record.peer is not None:
            return f"; the peer is rank {record.peer}"
        if len(record.group) < 2:
            return ""
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"threefold/roll-call/{'-'.join(map(str, record.group))}/{record.sequence}"
            store.set(f"{key}/{self.mesh.rank}", "here")
            deadline = time.monotonic() + min(ROLL_CALL_S, self.mesh.timeout.total_seconds())
            while True:
                missing = [r for r in record.group if not store.check([f"{key}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except Exception:  # the store itself may have gone with a lost rank: say what we know
            return ""
        if not missing:
            return "; every rank of the group reached it"
        return (f"; {agree(len(missing), 'rank')} {', '.join(map(str, missing))} of the group "
                f"{list(record.group)} did not reach it (dead, or stuck elsewhere)")

    def _run(self, op: str, axis: Axes, tag: str | None, nbytes: int, async_op: bool, call,
             peer: int | None = None, sent: float | None = None, alone=None) -> Pending | None:
        """Run ``call(group)`` and record it; in a group of one rank, ``alone()`` instead (what
        the operation does there: an out-of-place gather or scatter copies its input)."""
        axes = _axes(axis)
        n = self.mesh.size(*axes)
        group = tuple(self.mesh.ranks(*axes))
        record = CommRecord(op, self.mesh.label(*axes), tag, ring_bytes(op, nbytes, n) if sent is None else sent,
                            time.perf_counter(), group, self._issued.get(group, 0), peer)
        if n == 1:  # nothing to exchange
            if alone is not None:
                alone()
            return Pending(None, record, self) if async_op else None
        self._issued[group] = record.sequence + 1
        self.ledger.add(record)
        try:
            work = call(self.mesh.group(*axes))
        except RuntimeError as err:
            raise self.error(record, err) from err
        if async_op:
            return Pending(work, record, self)
        record.seconds = record.waited = time.perf_counter() - record.started
        return None


def ring_pass(comm: Comm, block: torch.Tensor, axis: str, visit, tag: str | None = None) -> list[float]:
    """Pass every rank's ``block`` once around the ring of ``axis`` (to coordinate r+1, from r−1):
    ``visit(owner, block)`` runs on each rank's block, this rank's own first, while the next one
    is already in flight. n−1 sends of the block: the bytes of an all-gather of the n blocks.
    Returns when each visit ended, to set beside the sends' launch times in the ledger."""
    n, me = comm.mesh.size(axis), comm.mesh.coord(axis)
    block, ends = block.contiguous(), []
    for step in range(n):
        if step < n - 1:  # the next block travels while this one is visited
            incoming = torch.empty_like(block)
            sending = comm.send(block, axis, (me + 1) % n, tag=tag)
            receiving = comm.recv(incoming, axis, (me - 1) % n, tag=tag)
        visit((me - step) % n, block)
        ends.append(time.perf_counter())
        if step < n - 1:
            sending.wait()
            receiving.wait()
            block = incoming
    return ends


def ring_reduce_scatter(comm: Comm, partial, axis: str, tag: str | None = None) -> tuple[torch.Tensor, list[float]]:
    """The sum over the ring of ``axis`` of every rank's ``partial(me)``, where ``partial(c)``
    returns a new tensor, this rank's addend for the block of the rank at coordinate c. Each
    block's running sum travels the ring (to r+1), gaining one rank's addend per hop, while the
    next addend is computed; after n−1 hops it reaches its owner. n−1 sends of a block: the
    bytes of a reduce-scatter. Returns (this rank's sum, when each ``partial`` ended)."""
    n, me = comm.mesh.size(axis), comm.mesh.coord(axis)
    ends, receiving = [], None
    for step in range(n):
        total = partial((me - step - 1) % n)  # the block whose sum arrives from r−1 this step
        ends.append(time.perf_counter())
        if receiving is not None:
            receiving.wait()
            total += incoming
            sending.wait()
        if step < n - 1:
            incoming = torch.empty_like(total)
            sending = comm.send(total, axis, (me + 1) % n, tag=tag)
            receiving = comm.recv(incoming, axis, (me - 1) % n, tag=tag)
    return total, ends


def _axes(axis: Axes) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _copy(output: torch.Tensor, input: torch.Tensor) -> None:
    """What a gather or scatter over one rank does: copy, unless ``output`` is ``input`` itself
    (in place). A dry run's fake tensors have no memory to compare: they copy (nothing moves)."""
    if isinstance(output, FakeTensor) or output.data_ptr() != input.data_ptr():
        output.view(-1).copy_(input.reshape(-1))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _AllToAll(torch.autograd.Function):
    """``all_to_all`` as a differentiable operation. Its transpose is itself with the split
    sizes swapped: the gradient of each row goes back to the rank that sent the row."""

    @staticmethod
    def forward(ctx, x, comm, axis, output_split_sizes, input_split_sizes, tag):
        ctx.comm, ctx.axis, ctx.tag = comm, axis, tag
        ctx.splits = (output_split_sizes, input_split_sizes)
        rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        out = x.new_empty((rows, *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), axis, output_split_sizes=output_split_sizes,
                        input_split_sizes=input_split_sizes, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        rows = grad.shape[0] if input_split_sizes is None else sum(input_split_sizes)
        grad_in = grad.new_empty((rows, *grad.shape[1:]))
        ctx.comm.all_to_all(grad_in, grad.contiguous(), ctx.axis, output_split_sizes=input_split_sizes,
                            input_split_sizes=output_split_sizes, tag=ctx.tag)
        return grad_in, None, None, None, None, None


def all_to_all_autograd(comm: Comm, x: torch.Tensor, axis: Axes, *, output_split_sizes: list[int] | None = None,
                        input_split_sizes: list[int] | None = None, tag: str | None = None) -> torch.Tensor:
    """``comm.all_to_all`` of ``x`` into a new tensor, through autograd (backward: the
    transposed all-to-all, counted like the forward one)."""
    return _AllToAll.apply(x, comm, axis, output_split_sizes, input_split_sizes, tag)
