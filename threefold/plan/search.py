"""Search the layouts of a model on a cluster: enumerate, drop what cannot run or does not fit,
rank by step time, and say in one line why each of the best wins or loses.

Every candidate is a row of numpy arrays and the cost model evaluates them all in one call,
which is what makes a full search of GPT-3 175B on 1024 GPUs take a fraction of a second.
"""
from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from threefold.config import ConfigError
from threefold.parallel.pipeline.schedule import SCHEDULE_REGISTRY, check_schedule
from threefold.plan import costs, report
from threefold.plan.costs import CP_METHODS, RECOMPUTE, SCHEDULES, Layout, Workload, recompute_policy
from threefold.words import plural

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
CONTEXT_PARALLEL = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (2, 3, 4, 6, 8)
TIE = 0.005  # layouts within this fraction of each other's step time are told as ties


def _divisors(n: int) -> list[int]:
    """n's divisors in increasing order, found up to √n (a GPU count may be in the millions)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _pipelines(layers: int, pp: int, schedule: str | None = None, v: int | None = None) -> list[tuple[int, int]]:
    """(schedule index, virtual stages) of every registered schedule for ``pp`` ranks (or only
    ``schedule``, ``v`` when fixed): chunked schedules with 2-8 chunks per rank; without a
    pipeline, 1F1B alone (they are all the same). Schedules that train on stale weights (2bw,
    pipedream: ``steady``) change the optimisation, not only its speed: only when asked for."""
    if pp == 1:  # no pipeline: a pipeline schedule fixed by the user takes no layout of one stage
        return [] if schedule not in (None, "1f1b") else [(SCHEDULES.index("1f1b"), v or 1)]
    return [(index, chunks) for index, (name, spec) in enumerate(SCHEDULE_REGISTRY.items())
            if schedule == name or (schedule is None and spec.steady is None)
            for chunks in ((v,) if v else VIRTUAL_STAGES if spec.chunked else (1,)) if pp * chunks <= layers]


@functools.lru_cache(maxsize=None)
def _runs(schedule: int, pp: int, microbatches: int, v: int, layers: int) -> bool:
    """Whether the registry accepts the schedule for this layout (its constraints, one per entry),
    on a split of ``layers`` as ``estimate`` checks it: every chunk as long as the longest."""
    chunks = costs.model_chunks(SCHEDULES[schedule], pp, v)
    if chunks > layers:
        return False
    try:
        check_schedule(SCHEDULES[schedule], pp, microbatches, v, costs.balanced_layers(layers, chunks))
    except ConfigError:
        return False
    return True


KNOBS = ("tp", "pp", "dp", "cp", "ep", "cp_method", "zero", "micro_batch", "virtual_stages", "sequence_parallel",
         "recompute", "schedule", "dp_shard", "reshard_after_forward", "expert_tp")


def _context_methods(cfg, tp: int, cp: int, fixed: dict) -> list[int]:
    """Indices into CP_METHODS the layout can run: all three with cp > 1 (ulysses only where cp
    divides each tp rank's query and key/value heads); without cp, ring stands for all."""
    if cp == 1:
        return [CP_METHODS.index(fixed.get("cp_method", "ring"))]
    return [i for i, name in enumerate(CP_METHODS) if fixed.get("cp_method", name) == name
            and (name != "ulysses" or not (cfg.heads // tp % cp or cfg.n_kv_heads // tp % cp))]


def _expert_placements(cfg, tp: int, dp: int, cp: int, sp_choices, fixed: dict) -> list[tuple[int, int]]:
    """(ep, expert_tp) pairs (``Layout.expert_tp``): every ep that divides the experts and the
    ranks it is carved from, with each placement that runs it. On threefold's engine (expert_tp 0)
    ep divides dp; on Megatron-Core's grid, searched by default (under tp only where SP is
    searched: it needs it), cp·dp with the experts split over tp (expert_tp = tp, where the tp
    ranks divide their width) and tp·cp·dp with them whole (expert_tp 1). Where the grid prices
    as the engine's (``costs.expert_grid_differs``: tp 1, cp 1, ep dividing dp) only the engine's
    row is kept, unless expert_tp 1 is given. (1, 0) for a dense model."""
    if not cfg.moe_experts:
        return [(1, 0)] if fixed.get("ep", 1) == 1 else []
    given = fixed.get("expert_tp")
    grid = given != 0 and (tp == 1 or True in sp_choices)
    pairs = []
    for ep in _divisors(tp * cp * dp):
        if cfg.moe_experts % ep or ep != fixed.get("ep", ep):
            continue
        differs = bool(costs.expert_grid_differs(tp, cp, dp, ep))
        if dp % ep == 0 and (given == 0 or (given is None and not differs)):
            pairs.append((ep, 0))
        if not grid:
            continue
        if tp > 1 and given in (None, tp) and cfg.moe_ffn_hidden % tp == 0 and (cp * dp) % ep == 0:
            pairs.append((ep, tp))
        if given == 1 or (given is None and differs):
            pairs.append((ep, 1))
    return pairs


def candidate_layouts(work: Workload, num_gpus: int, fixed: dict | None = None) -> Layout:
    """Every layout that can run the model on ``num_gpus`` GPUs, as arrays; ``fixed`` maps knobs
    (KNOBS; recompute and schedule by name) to the one value the user fixed.

    TP: powers of two dividing the heads, kv heads and FFN width; PP: any divisor up to the
    layer count; CP: 1-16 dividing half the sequence (the zigzag split), with each method that
    runs (``_context_methods``); DP fills the rest; EP: each divisor of the ranks it is carved
    from that divides the experts, with each placement of the experts that runs it (MoE models
    only: ``_expert_placements``).
    Then every ZeRO stage (ZeRO-3 also with hybrid sharding over each
    divisor of dp from 2 up that is a multiple of ep: ``_with_hybrid_sharding``),
    micro-batch, recomputation, sequence parallelism (with TP > 1) and pipeline schedule
    (every schedule of the registry that accepts the layout; chunked ones with 2-8 chunks per
    rank; pipelines only when PP > 1). A fixed knob replaces its range by its one value.
    """
    cfg, fixed = work.model, {k: v for k, v in (fixed or {}).items() if v is not None}
    grids = []
    for tp, pp, cp in itertools.product(_divisors(num_gpus), repeat=3):
        if (tp * pp * cp > num_gpus or num_gpus % (tp * pp * cp) or cfg.heads % tp
                or cfg.n_kv_heads % tp or cfg.ffn_hidden % tp or pp > cfg.layers
                or cfg.seq_len % (2 * cp if cp > 1 else 1)
                or (tp & (tp - 1) if "tp" not in fixed else tp != fixed["tp"])
                or (cp not in CONTEXT_PARALLEL if "cp" not in fixed else cp != fixed["cp"])
                or pp != fixed.get("pp", pp) or num_gpus // (tp * pp * cp) != fixed.get("dp", num_gpus // (tp * pp * cp))):
            continue
        dp = num_gpus // (tp * pp * cp)
        micro = [b for b in ((fixed["micro_batch"],) if "micro_batch" in fixed else MICRO_BATCHES)
                 if work.global_batch % (dp * b) == 0]
        parallel = [x for x in ((fixed["sequence_parallel"],) if "sequence_parallel" in fixed else (False, True))
                    if tp > 1 or not x]
        for b, (schedule, v), sp, method, (ep, expert_tp) in itertools.product(
                micro, _pipelines(cfg.layers, pp, fixed.get("schedule"), fixed.get("virtual_stages")),
                parallel, _context_methods(cfg, tp, cp, fixed), _expert_placements(cfg, tp, dp, cp, parallel, fixed)):
            if (pp > 1 or v > 1) and not _runs(schedule, pp, work.global_batch // (dp * b), v, cfg.layers):
                continue
            if expert_tp and tp > 1 and not sp:  # Megatron-Core's grid runs under tp only with SP
                continue
            grids.append((tp, pp, dp, cp, b, v, sp, schedule, ep, method, expert_tp))
    if not grids:
        return Layout(*(np.zeros(0, dtype=int) for _ in fields(Layout)))
    base = np.array(grids, dtype=np.int64)
    # Every base row with every ZeRO stage and recomputation mode (or the fixed ones).
    zeros = np.array([fixed["zero"]] if "zero" in fixed else range(4))
    # Every mode; recompute_policy reads selective at ZeRO-3 under flash attention as op, so op is
    # searched below ZeRO-3 only there (and not at all under eager attention, which it needs flash for).
    modes = np.array([RECOMPUTE.index(fixed["recompute"])] if "recompute" in fixed
                     else range(len(RECOMPUTE) - (work.attention != "flash")))
    rows = np.repeat(base, len(zeros) * len(modes), axis=0)
    zero = np.tile(np.repeat(zeros, len(modes)), len(base))
    named = np.tile(modes, len(zeros) * len(base))
    twice = (named == RECOMPUTE.index("op")) & (zero == 3) & ("recompute" not in fixed)  # selective's row is it
    rows, zero, named = rows[~twice], zero[~twice], named[~twice]
    recompute = recompute_policy(named, zero, work.attention)
    tp, pp, dp, cp, b, v, sp, schedule, ep, method, expert_tp = rows.T
    layouts = Layout(tp=tp, pp=pp, dp=dp, cp=cp, zero=zero, micro_batch=b, virtual_stages=v,
                     sequence_parallel=sp.astype(bool), recompute=recompute, schedule=schedule, ep=ep, cp_method=method,
                     dp_shard=np.zeros_like(zero), reshard_after_forward=np.ones_like(zero, dtype=bool),
                     expert_tp=expert_tp)
    # a schedule that runs W apart from B is not priced under full recomputation (costs.check_layout)
    split_backward = np.array([SCHEDULE_REGISTRY[name].split_backward for name in SCHEDULES])[schedule] & (pp > 1)
    layouts = layouts.take(~(split_backward & (recompute == RECOMPUTE.index("full"))))
    layouts = _with_hybrid_sharding(layouts, num_gpus, fixed.get("dp_shard"))
    return _with_kept_gathered(layouts, fixed.get("reshard_after_forward"))


def _with_kept_gathered(layouts: Layout, reshard: bool | None) -> Layout:
    """With --no-reshard-after-forward, the ZeRO-3 layouts with their units kept gathered through
    the step, and only those. Otherwise none: priced as ZeRO-1 (costs.estimate), they would repeat
    the search's ZeRO-1 rows."""
    if reshard is not False:
        return layouts
    kept = layouts.take(np.flatnonzero(np.asarray(layouts.zero) == 3))
    kept.reshard_after_forward = np.zeros_like(kept.zero, dtype=bool)
    return kept


def _with_hybrid_sharding(layouts: Layout, num_gpus: int, dp_shard: int | None) -> Layout:
    """The ZeRO-3 layouts again with hybrid sharding over shard groups of s dp ranks, for every
    divisor s of dp with 2 ≤ s < dp that holds whole ep groups (s = dp is ZeRO-3 itself); with
    --dp-shard fixed, only those with that s, and where dp = s plain ZeRO, the ZeRO-1 and 2 layouts
    too (searched over every s they would triple the layouts, for what ZeRO-3's groups mostly
    find); --dp-shard 0, none."""
    if dp_shard == 0:
        return layouts
    zero = np.asarray(layouts.zero)
    sharded = np.flatnonzero(zero >= 1 if dp_shard else zero == 3)
    dp, ep = np.asarray(layouts.dp)[sharded], np.asarray(layouts.ep)[sharded]
    shards = [dp_shard] if dp_shard else [s for s in _divisors(num_gpus) if s >= 2]
    parts = [] if dp_shard else [layouts]
    for s in shards:
        rows = layouts.take(sharded[(dp % s == 0) & (s % ep == 0) & ((dp > s) | (dp_shard == s))])
        rows.dp_shard = np.where(np.asarray(rows.dp) > s, s, 0)
        parts.append(rows)
    return Layout(**{f.name: np.concatenate([np.asarray(getattr(part, f.name)) for part in parts])
                     if parts else np.zeros(0, dtype=int) for f in fields(Layout)})


MESH_AXES = ("tp", "pp", "dp", "cp", "ep")  # what makes two layouts different meshes


@dataclass
class SearchResult:
    work: Workload
    gpu: object
    layouts: Layout
    est: dict
    order: np.ndarray  # indices of fitting layouts, fastest first
    count: int
    seconds: float  # wall-clock
    cpu_seconds: float = 0.0  # this process's CPU time: the search's own work, whatever else runs

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("inf")

    @property
    def fitting(self) -> int:
        return len(self.order)

    def shown(self, top: int) -> list[int]:
        """Indices of the fastest layout of each of the ``top`` fastest meshes (TP, PP, DP, CP, EP).
        Variants of one mesh (ZeRO stage, recomputation) often tie; showing one of each keeps
        the near misses informative."""
        mesh = np.stack([np.asarray(getattr(self.layouts, axis))[self.order] for axis in MESH_AXES], axis=1)
        _, first = np.unique(mesh, axis=0, return_index=True)
        return [int(i) for i in self.order[np.sort(first)[:top]]]

    def mesh_of(self, i: int) -> tuple[int, ...]:
        """Layout ``i``'s mesh (TP, PP, DP, CP, EP): what ``shown`` keeps one row of."""
        return tuple(int(np.asarray(getattr(self.layouts, axis))[i]) for axis in MESH_AXES)

    def table_row(self, i: int, top: int) -> tuple[int | None, bool]:
        """Where layout ``i`` sits in the table of ``shown(top)``: its row (from 1) and whether it is
        that row's own layout (else a variant of it: the row's mesh at another ZeRO stage,
        schedule, …), or (None, False) where its mesh is not in the table."""
        shown, mesh = self.shown(top), self.mesh_of(i)
        row = next((k for k, j in enumerate(shown, 1) if self.mesh_of(j) == mesh), None)
        return row, row is not None and shown[row - 1] == i

    def ranked(self, top: int) -> list[tuple[dict, str]]:
        """The layouts ``shown``, as JSON with ``describe``, and why each wins or loses."""
        out = []
        for i in self.shown(top):
            result = report.result_json(self.est, self.layouts, i)
            result["describe"] = self.layouts.describe(i)
            out.append((result, self.explain(i)))
        return out

    def _get(self, key: str, i: int) -> float:
        return float(np.asarray(self.est[key])[i])

    @staticmethod
    def _zero_phrase(lay: dict) -> str:
        """ZeRO-1 over 32 replicas; hybrid sharding: ZeRO-3 over 8 ranks, all-reduced between 4 groups."""
        if lay["dp_shard"]:
            return (f"ZeRO-{lay['zero']} over {plural(lay['dp_shard'] * lay['cp'], 'rank')}, all-reduced between "
                    f"{plural(lay['dp'] // lay['dp_shard'], 'group')}")
        return f"ZeRO-{lay['zero']} over {plural(lay['dp'] * lay['cp'], 'replica')}"

    def _phrase(self, part: str, i: int) -> str:
        """One clause saying what ``part`` of layout ``i``'s step time comes from."""
        lay = {f.name: int(np.asarray(getattr(self.layouts, f.name))[i]) for f in fields(Layout)}
        seconds = self._get(f"{part}_s", i)
        if part == "bubble":
            return (f"PP={lay['pp']} with {plural(int(self._get('microbatches', i)), 'micro-batch')}: "
                    f"{self._get('bubble_fraction', i):.0%} bubble")
        if part == "tp_exposed":
            where = "crosses nodes" if lay["tp"] > self.gpu.gpus_per_node else "within a node"
            return f"TP={lay['tp']} {where}: {seconds:.2f} s of exposed TP traffic"
        if part == "dp_exposed":
            return f"{self._zero_phrase(lay)}: {seconds:.2f} s of exposed DP traffic"
        if part == "pp_exposed":
            return f"PP={lay['pp']}: {seconds:.2f} s of exposed pipeline transfers"
        if part == "cp_exposed":
            method = CP_METHODS[lay["cp_method"]]
            where = "crosses nodes" if lay["tp"] * lay["cp"] > self.gpu.gpus_per_node else "within a node"
            hidden = self._get("cp_s", i) - seconds
            behind = f", {hidden:.2f} s more hidden behind the attention" if method == "ring" and hidden > 0.005 else ""
            return f"CP={lay['cp']} {method} {where}: {seconds:.2f} s of exposed key/value exchange{behind}"
        if part == "ep_exposed":
            span = int(costs.ep_stride(lay["tp"], lay["cp"], lay["expert_tp"])) * lay["ep"]
            where = "crosses nodes" if span > self.gpu.gpus_per_node else "within a node"
            return f"EP={lay['ep']} {where}: {seconds:.2f} s of all-to-all per step"
        if part == "compute":
            mode = RECOMPUTE[lay["recompute"]]
            if mode != "none":
                return f"{mode} recompute: {seconds:.2f} s of math"
            layers = self.work.model.layers
            if layers % lay["pp"]:
                return f"PP={lay['pp']} splits {layers} layers unevenly: {seconds:.2f} s of math on the fullest stage"
            return f"{seconds:.2f} s of math on the last stage (its blocks and the logits)"
        if part == "memory_bound":
            if lay["tp"] == 1:
                return f"{seconds:.2f} s of memory-bound element-wise work"
            sp = "with" if lay["sequence_parallel"] else "without"
            return f"{seconds:.2f} s of memory-bound element-wise work ({sp} sequence parallelism)"
        if part == "contention":
            return f"{self._zero_phrase(lay)}: {seconds:.2f} s of compute slowed by the data-parallel traffic it hides"
        if part == "stragglers":
            n = int(self._get("num_gpus", i))
            return f"{seconds:.2f} s waiting for the slowest of {n:,} GPUs (speed spread {self.gpu.speed_spread:.1%})"
        if part == "optimizer":
            return f"{seconds:.2f} s of optimizer step" + (" (unsharded)" if lay["zero"] == 0 else "")
        raise ValueError(f"no phrase for the step's part {part!r}")

    def explain(self, i: int) -> str:
        """Why layout ``i`` wins (its largest overhead) or loses (what it spends more on than #1)."""
        best = int(self.order[0])
        if i == best:
            # the slowest GPU's lag is the same share of every layout's step: not what makes one win
            overhead = max((p for p in report.TIME_PARTS if p not in ("compute", "stragglers")),
                           key=lambda p: self._get(f"{p}_s", i))
            share = self._get("compute_s", i) / self._get("step_time_s", i)
            # What its expert and context parallelism cost, when that is not already the largest part
            also = "".join(f"; {self._phrase(part, i)}" for part, axis in (("ep_exposed", "ep"), ("cp_exposed", "cp"))
                           if part != overhead and int(np.asarray(getattr(self.layouts, axis))[i]) > 1)
            return f"fastest: {share:.0%} of the step is math; largest overhead: {self._phrase(overhead, i)}{also}"
        deltas = {p: self._get(f"{p}_s", i) - self._get(f"{p}_s", best) for p in report.TIME_PARTS}
        worst, saved = max(deltas, key=deltas.get), min(deltas, key=deltas.get)
        step_best = self._get("step_time_s", best)
        gap = self._get("step_time_s", i) - step_best
        trade = f"; saves {-deltas[saved]:.2f} s of {saved.replace('_', ' ')}" if deltas[saved] < -0.005 else ""
        if gap <= TIE * step_best:  # a tie: say what differs instead of a gap of +0.00 s
            mine, theirs = self.layouts.describe(i).split(), self.layouts.describe(best).split()
            differs = " ".join(part for part in mine if part not in theirs) or "a variant of #1"
            keys = {part.split("=")[0] for part in mine}
            dropped = [part for part in theirs if part not in mine and part.split("=")[0] not in keys and part != "none"]
            differs += f", without {' '.join(dropped)}" if dropped else ""
            memory = self._get("memory_bytes", i) / 2**30, self._get("memory_bytes", best) / 2**30
            cost = (f"{deltas[worst]:+.2f} s of {worst.replace('_', ' ')}{trade}" if deltas[worst] > 0.005
                    else "the same time in every part of the step")
            return (f"ties #1 (within {max(gap, 0) / step_best:.1%}) with {differs}: {cost}; "
                    f"{memory[0]:.1f} GiB per GPU against #1's {memory[1]:.1f}")
        return f"+{gap:.2f} s ({gap / step_best:+.0%}) vs #1; {self._phrase(worst, i)}{trade}"

    def meshes(self) -> int:
        """How many distinct meshes (tp, pp, dp, cp, ep) the fitting layouts use."""
        if not self.fitting:
            return 0
        mesh = np.stack([np.asarray(getattr(self.layouts, a))[self.order] for a in MESH_AXES], axis=1)
        return len(np.unique(mesh, axis=0))

    def what_would_change(self) -> list[str]:
        """The cluster knob that would change #1: each link bandwidth halved or doubled, every
        fitting layout re-evaluated (memory does not depend on the links, so what fits stays the
        same); one line for the variant under which another layout beats #1 by the most, if by
        more than a tie (TIE of #1's time there: a change of 0.0001 s is no reason to buy a network)."""
        if not self.fitting:
            return []
        sub = self.layouts.take(self.order)  # fitting, fastest first: #1 is row 0
        best = None  # (#1's time lost to the winner there, as a fraction; the line)
        for key, label in (("inter_node_bw", "across nodes"), ("intra_node_bw", "within a node")):
            for factor in (2.0, 0.5):
                value = getattr(self.gpu, key) * factor
                steps = np.asarray(estimate_all(self.work, sub, replace(self.gpu, **{key: value}))
                                   ["step_time_s"])
                j = int(np.argmin(steps))
                gain = (steps[0] - steps[j]) / steps[0]
                if gain > TIE and (best is None or gain > best[0]):
                    faster, slower = _apart(steps[j], steps[0])
                    best = (gain, f"with {value * 8e-9:,.0f} Gb/s per GPU {label} (now {getattr(self.gpu, key) * 8e-9:,.0f}), "
                                  f"{self.layouts.describe(int(self.order[j]))} ({faster} s) would overtake "
                                  f"{self.layouts.describe(int(self.order[0]))} ({slower} s).")
        if best is None:
            return [f"Halving or doubling either link bandwidth would not change #1 (by more than a tie, {TIE:.1%})."]
        return [best[1]]

    def notes(self) -> list[str]:
        """One line: the fastest layout that misses the memory by less than a quarter, if it
        would beat the winner (what a little more memory, or less, would buy)."""
        fits = np.asarray(self.est["fits"])
        step, memory = np.asarray(self.est["step_time_s"]), np.asarray(self.est["memory_bytes"])
        near = np.flatnonzero(~fits & (memory <= 1.25 * self.gpu.hbm_bytes))
        if not len(near):
            return []
        i = int(near[np.argmin(step[near])])
        if len(self.order) and step[i] >= step[self.order[0]]:
            return []
        return [f"Near miss on memory: {self.layouts.describe(i)} would take {step[i]:.2f} s "
                f"but needs {memory[i] / 2**30:.1f} GiB per GPU."]

    def closest_miss(self) -> str:
        """``: the smallest needs X GiB (layout)`` for the error when nothing fits."""
        if not self.count:
            return ": no layout divides the model and the GPUs"
        i = int(np.argmin(np.asarray(self.est["memory_bytes"])))
        return f"; the leanest, {self.layouts.describe(i)}, needs {self._get('memory_bytes', i) / 2**30:.0f} GiB per GPU"


def _apart(faster: float, slower: float) -> tuple[str, str]:
    """Two step times with the fewest decimals (two to four) that print them apart."""
    for digits in (2, 3):
        if f"{faster:.{digits}f}" != f"{slower:.{digits}f}":
            break
    else:
        digits = 4
    return f"{faster:.{digits}f}", f"{slower:.{digits}f}"


BLOCK = 1 << 15  # layouts per vectorised call: its temporaries stay in the allocator's arenas


def estimate_all(work: Workload, layouts: Layout, gpu) -> dict:
    """``costs.estimate`` of every layout, in blocks of BLOCK: one call over a million layouts
    makes a hundred temporaries of megabytes each, and mapping and unmapping them took most of
    the time (DeepSeek-V3's 1.8M layouts: 14.8 s of 18 in the kernel)."""
    n = len(np.asarray(layouts.tp))
    if n <= BLOCK:
        return costs.estimate(work, layouts, gpu)
    starts = range(0, n, BLOCK)
    parts = [costs.estimate(work, layouts.take(slice(start, start + BLOCK)), gpu) for start in starts]
    sizes = [min(BLOCK, n - start) for start in starts]
    return {key: np.concatenate([np.broadcast_to(part[key], (size,)) for part, size in zip(parts, sizes)])
            for key in parts[0]}


def search(work: Workload, gpu, num_gpus: int, fixed: dict | None = None) -> SearchResult:
    """Enumerate, evaluate, drop what does not fit, rank by step time (ties: less memory first)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    layouts = candidate_layouts(work, num_gpus, fixed)
    est = estimate_all(work, layouts, gpu)
    fits = np.asarray(est["fits"], dtype=bool)
    step, memory = np.asarray(est["step_time_s"]), np.asarray(est["memory_bytes"])
    candidates = np.flatnonzero(fits)
    order = candidates[np.lexsort((memory[candidates], step[candidates]))]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return SearchResult(work, gpu, layouts, est, order, len(np.asarray(layouts.tp)), seconds, cpu_seconds)
