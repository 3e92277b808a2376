"""``threefold compare``: the planner's prediction beside what a training run measured.

The run's metrics file holds global rank 0's figures: the first pipeline stage, tp rank 0,
dp rank 0. Its memory and bytes per ledger key are predicted by ``dryrun_predict.predict_rank``,
the same figures ``threefold dryrun --compare`` puts beside a dry run (model states, activations
of the rank's seq_len / cp tokens with the head's where it holds it, and every axis the planner
prices: dp, dp+cp, cp, cp.routing, tp.routing, ep, tp, tp.loss, tp.scatter_gather, pp); each row says which
formula it used. Exposed communication per axis and the step time come from costs.estimate with
the profile ``threefold calibrate`` measured.

Measured figures are the median over the steps after each launch's first (which pays for warm-up).
Where no exact formula exists for rank 0, the formula column says so.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import click

from threefold.config import Config, ConfigError
from threefold.configure import load_config
from threefold.plan import costs
from threefold.plan.dryrun_predict import RankShare, predict_rank, rank_share
from threefold.plan.records import is_number, read_records, steady
from threefold.words import plural


@dataclass(frozen=True)
class Row:
    quantity: str
    predicted: float | None  # None: no prediction (the formula column says why)
    measured: float
    formula: str
    unit: str = "B"

    @property
    def ratio(self) -> float | None:
        """measured / predicted; 1 when both are 0."""
        if self.predicted is None or (self.predicted == 0 and self.measured != 0):
            return None
        return 1.0 if self.predicted == self.measured else self.measured / self.predicted

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), ratio=self.ratio)


def resolved(cfg: Config) -> Config:
    """The config as the run trained it: the vocabulary defaults to the tokenizer's."""
    if cfg.model.vocab_size is not None:
        return cfg
    from threefold.data import prepare_dataset

    dataset = prepare_dataset(cfg.data, cfg.model.seq_len, progress=False)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=dataset.tokenizer.vocab_size))


def load_run(config_path, overrides=()) -> Config:
    """A run's config as it trained: the TOML file with its overrides, the vocabulary resolved."""
    return resolved(load_config(config_path, overrides))


def read_steps(metrics_path: str | Path, flag: str = "--metrics-file") -> list[dict]:
    """The steady step records of a metrics file (``read_records``, ``records.steady``: each
    launch's first step left out); ConfigError, one line, for a file that is not one."""
    return steady(read_records(metrics_path, flag))


def _layout_words(cfg: Config) -> str:
    p = cfg.parallel
    return (f"dp={p.dp} tp={p.tp} pp={p.pp}{f' cp={p.cp}' if p.cp > 1 else ''} zero={p.zero}, "
            f"{plural(cfg.model.layers, 'layer')} of {cfg.model.hidden}")


def check_same_run(cfg: Config, want: dict, steps: list[dict], metrics_path) -> None:
    """Refuse, in one line, a config that is not the one the metrics file's run trained with:
    the file does not record its config, but its rank 0's parameter bytes, the axes that
    carried traffic and the tokens of a step (its tokens/s × seconds) give it away."""
    p = cfg.parallel
    measured = steps[-1]["memory"].get("params")
    predicted = want["memory"]["params"]  # predict_rank's, for rank 0
    layout = _layout_words(cfg)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    rate = steps[-1].get("tokens_per_s")
    if is_number(rate) and abs(rate * steps[-1]["step_time_s"] / tokens - 1) > 0.01:
        raise ConfigError(f"--config: {metrics_path} was written by a run of another batch: its steps trained "
                          f"{rate * steps[-1]['step_time_s']:,.0f} tokens each, this config "
                          f"{cfg.train.global_batch} × {cfg.model.seq_len} = {tokens:,} (train.global_batch, "
                          "model.seq_len)")
    if measured is not None and measured != predicted:
        raise ConfigError(f"--config: {metrics_path} was written by another model or layout: its rank 0 holds "
                          f"{measured:,.0f} bytes of parameters, this config ({layout}) gives {predicted:,.0f}")
    sizes = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp}
    for axis, size in sizes.items():  # an axis's traffic, alone or with others ("dp+cp") or a kind of it ("tp.loss")
        traffic = any(sent for step in steps for key, sent in step["comm_bytes"].items()
                      if axis in key.split(".")[0].split("+"))
        if traffic != (size > 1):
            raise ConfigError(f"--config: {metrics_path} was written by another layout: its run "
                              f"{'sent' if traffic else 'sent nothing'} on the {axis} axis, this config has "
                              f"{axis}={size} ({layout})")


def run_layout(cfg: Config, moe_imbalance: float = 1.0) -> tuple[costs.Workload, costs.Layout]:
    """The planner's workload and layout of a training config, as the engine runs it: fp32 or
    bf16 compute, the attention of PyTorch's scaled_dot_product_attention (no stored scores);
    under expert parallelism the routing imbalance the run measured (``measured_imbalance``)."""
    p, t = cfg.parallel, cfg.train
    layout = costs.Layout.named(recompute=t.recompute, schedule=p.schedule, cp_method=p.cp_method, tp=p.tp,
                                pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep,
                                zero=p.zero, micro_batch=t.micro_batch, virtual_stages=p.virtual_stages,
                                sequence_parallel=p.sequence_parallel, dp_shard=p.dp_shard,
                                reshard_after_forward=p.resharding, expert_tp=int(p.experts_folded))
    work = costs.Workload(cfg.model, t.global_batch, precision="fp32" if t.dtype == "float32" else "autocast",
                          tp_comm_overlap=p.tp_overlap, sequence_copies=True, moe_imbalance=moe_imbalance,
                          bucket_params=p.bucket_mb * 2**20 / 4)  # the engine's buckets hold fp32 gradients
    return work, layout


def measured_imbalance(cfg: Config, steps: list[dict]) -> float:
    """The median over a run's steps of its busiest ep rank's routed rows over the mean (the
    metrics' ``moe.ep_max_over_mean``, at least 1); 1 without expert parallelism or the record."""
    seen = [step["moe"]["ep_max_over_mean"] for step in steps if "ep_max_over_mean" in (step.get("moe") or {})]
    return max(1.0, statistics.median(seen)) if cfg.parallel.ep > 1 and seen else 1.0


def run_split(cfg: Config) -> tuple[int, ...] | None:
    """The pipeline split a run trained with (``parallel.stage_layers``: set by hand, or by
    compare_run from the run's timeline), for estimate() to price; None without one."""
    p = cfg.parallel
    return tuple(p.stage_layers) if p.pp > 1 and p.stage_layers else None


def with_run_split(cfg: Config, steps: list[dict], metrics_path="--metrics-file") -> Config:
    """The config with the split its run chose (measured costs, or by hand), read off the
    metrics' timeline; unchanged where the steps record none. ConfigError, one line, where the
    timeline's pipeline is not the config's (another layout's file)."""
    timeline = steps[-1].get("timeline")
    p = cfg.parallel
    if timeline and (timeline["pp"], timeline["virtual_stages"]) != (p.pp, p.virtual_stages):
        raise ConfigError(f"--config: {metrics_path} was written by another layout: its pipeline had "
                          f"pp={timeline['pp']} with {plural(timeline['virtual_stages'], 'chunk')} a rank, this config "
                          f"pp={p.pp} with {p.virtual_stages} ({_layout_words(cfg)})")
    if timeline and timeline.get("stage_layers"):
        return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, stage_layers=timeline["stage_layers"]))
    return cfg


def estimate_run(cfg: Config, gpu, moe_imbalance: float = 1.0) -> dict:
    """estimate() of a training config's layout on ``gpu``, at the run's pipeline split where it
    has one, with the routing imbalance it measured (``measured_imbalance``)."""
    work, layout = run_layout(cfg, moe_imbalance)
    return costs.estimate(work, layout, gpu, stage_split=run_split(cfg))


def priced_step(cfg: Config, steps: list[dict], moe_imbalance: float | None = None) -> float:
    """The step time estimate() gives a run on the local profile, at its pipeline split and at the
    routing imbalance it measured, or at ``moe_imbalance`` (1: balanced)."""
    from threefold.plan.hardware import local_gpu

    run = with_run_split(resolved(cfg), steps)
    imbalance = measured_imbalance(run, steps) if moe_imbalance is None else moe_imbalance
    return float(estimate_run(run, local_gpu(run.train.dtype, workers=run.parallel.world_size), imbalance)["step_time_s"])


def measured_step_time(steps: list[dict]) -> float:
    """The median step time of a run's steps (read_steps': each launch's first, which pays for warm-up, left out)."""
    return statistics.median(step["step_time_s"] for step in steps)


DRIFT_WINDOW = 10  # consecutive steps in one stretch of step_time_drift
DRIFT_APART = 0.15  # stretches further apart than this: the machine's speed moved during the run


def step_time_drift(steps: list[dict], window: int = DRIFT_WINDOW) -> dict | None:
    """The fastest and the slowest stretch of ``window`` consecutive steps (their mean step
    times and first and last step numbers) when the slowest is more than DRIFT_APART slower,
    else None (and for runs shorter than two stretches). A shared machine's speed moves over
    minutes, and the prediction's profile was measured at one of them: ``make demo`` on
    2026-12-03 ran 1.86 s a step over steps 2-11 and 2.46 s over steps 52-61."""
    stretches = [steps[i:i + window] for i in range(0, len(steps) - window + 1, window)]
    if len(stretches) < 2:
        return None
    means = [statistics.mean(step["step_time_s"] for step in stretch) for stretch in stretches]
    fast, slow = means.index(min(means)), means.index(max(means))
    if means[slow] <= (1 + DRIFT_APART) * means[fast]:
        return None
    span = [(stretch[0].get("step"), stretch[-1].get("step")) for stretch in stretches]
    return {"fast_s": means[fast], "fast_steps": span[fast], "slow_s": means[slow], "slow_steps": span[slow]}


def bytes_formulas(cfg: Config, share: RankShare) -> dict[str, str]:
    """The formula behind each ledger key predict_rank prices for rank 0, in the rows' order."""
    p = cfg.parallel
    grads = f"dp_bytes_per_step of rank 0's {share.numel:,} elements" + (" and its experts'" if share.moe_blocks else "")
    hsdp = p.dp_shard and p.cp > 1
    over_dp = f" over dp, sharded over groups of dp_shard={p.dp_shard}" if p.dp_shard else " over dp"
    return {"dp": ("hsdp_all_reduce_bytes: the all-reduce between the shard groups" if hsdp
                   else grads + over_dp),
            "dp+cp": grads + " over dp × cp" + (", less the all-reduce between the shard groups" if hsdp else ""),
            "cp": (grads + " over cp + " if p.dp == 1 else "") + f"context.cp_bytes_per_step ({p.cp_method}) "
                  f"of its {plural(share.blocks, 'block')}",
            "cp.routing": "context.moe_bytes_per_step: the routing statistics over the micro-batch",
            "tp.routing": "context.moe_bytes_per_step over the tp ranks, each routing its own positions (folded)",
            "cp+tp.routing": "context.moe_bytes_per_step over the cp and tp ranks, each routing its share (folded)",
            "ep": "ep_bytes_per_step: the experts' dispatch and combine",
            "tp": f"tp_bytes_per_step, {plural(share.blocks, 'block')}" + (", the embedding" if share.first_stage else "")
                  + (", the head" if share.last_stage else ""),
            "tp.loss": "tp_loss_bytes_per_step",
            "tp.partial_grads": "2(t−1)/t · 4 · tp_partial_numel: the norm gains'" + (" and MoE blocks'" if share.moe_blocks
                                                                                    else "") + " gradients, summed over tp",
            "tp.scatter_gather": "scatter_gather_bytes_per_step: the stage boundary's tp scatter and gather",
            "pp": "pp_bytes_per_step of pipeline rank 0"}


def compare_run(cfg: Config, metrics_path: str | Path) -> list[Row]:
    """Rows of (quantity, predicted, measured, ratio, formula) for global rank 0 of the run."""
    from threefold.plan.hardware import CATALOG, local_gpu

    steps = read_steps(metrics_path)  # a bad file is refused before the tokenizer is read
    cfg = resolved(cfg)
    timeline = steps[-1].get("timeline")
    cfg = with_run_split(cfg, steps, metrics_path)

    def measured(get) -> float:
        return statistics.median(get(step) for step in steps)

    p, t, model = cfg.parallel, cfg.train, cfg.model
    share, want = rank_share(cfg, 0), predict_rank(cfg, 0)  # the planner's figures for rank 0
    check_same_run(cfg, want, steps, metrics_path)
    rows = []

    over = (f"dp_shard={p.dp_shard} of dp={p.dp}" if p.dp_shard else f"dp={p.dp}") + (f" × cp={p.cp}" if p.cp > 1 else "")
    experts = ", routed experts apart" if share.moe_blocks else ""
    for kind in ("params", "grads", "optimizer"):
        rows.append(Row(f"memory: {kind}", want["memory"][kind], measured(lambda s: s["memory"][kind]),
                        f"model_state_bytes of rank 0's {share.numel:,} elements (tp shard of its stage{experts}), "
                        f"ZeRO-{p.zero} over {over}"))
    if "weight_versions" in want["memory"]:  # 2bw, pipedream
        rows.append(Row("memory: weight_versions", want["memory"]["weight_versions"],
                        measured(lambda s: s["memory"].get("weight_versions", 0)),
                        "weight_versions: fp32 copies of the stage's weights"))
    flight = f", up to {share.in_flight} (micro-batch, stage) in flight" if p.pp > 1 else ""
    own = f", {p.cp_method}'s own saves" if t.recompute == "none" else ""  # as predict_rank counts them
    tokens = f"{t.micro_batch} × {model.seq_len // p.cp} tokens" + (f" (seq_len / cp{own})" if p.cp > 1 else "")
    rows.append(Row("memory: activations, peak", want["memory"]["activations"],
                    measured(lambda s: s["memory"]["activations"]),
                    f"{share.blocks_in_flight} × block_activation_bytes of {tokens}{flight}"
                    + (" + the final norm and logits (head_activation_bytes)" if share.last_stage else "")
                    + " + token ids and masks (bookkeeping_activation_bytes)"))

    try:
        gpu, missing = local_gpu(t.dtype, workers=p.world_size), None  # the run's dtype, its ranks on these cores
    except ConfigError as err:
        gpu, missing = CATALOG["a100-80gb"], str(err)  # only for estimate()'s bytes, which no GPU changes
    imbalance = measured_imbalance(cfg, steps)
    est = estimate_run(cfg, gpu, imbalance)

    def axis(key: str) -> float:
        return measured(lambda s: s["comm_bytes"].get(key, 0))

    formulas = bytes_formulas(cfg, share)
    for key in sorted(want["comm_bytes"], key=lambda k: list(formulas).index(k)):
        rows.append(Row(f"bytes/step: {key}", want["comm_bytes"][key], axis(key), formulas[key]))
    others = sorted({key for s in steps for key in s["comm_bytes"]} - set(want["comm_bytes"]))
    others = [key for key in others if axis(key)]  # keys with traffic in the training steps
    if others:  # bookkeeping the planner leaves out: scalars, the tied embedding, timelines
        rows.append(Row("bytes/step: other", None, sum(axis(key) for key in others),
                        "not modelled by the planner: " + ", ".join(f"{key} {axis(key):,.0f}" for key in others)))

    least_gpu = gpu.without_skew()  # itself on a GPU and on a profile without waits: no second estimate
    rows += exposed_rows(cfg, steps, None if missing else est, missing,
                         None if missing or least_gpu is gpu else estimate_run(cfg, least_gpu, imbalance))
    if timeline:  # the stage the others wait for: predicted as the mean stage (balanced), measured the slowest
        from threefold.plan.measured import stage_bottleneck

        neck = stage_bottleneck(timeline)
        rows.append(Row("pipeline: slowest stage, compute per micro-batch",
                        sum(neck["stage_seconds"]) / len(neck["stage_seconds"]),
                        neck["stage_seconds"][neck["slowest_stage"]],
                        f"predicted: the mean stage (a balanced split); {neck['line']}", unit="s"))
    rows.append(Row("step time", None if missing else est["step_time_s"], measured_step_time(steps),
                    f"{missing} (under two minutes)" if missing else
                    f"estimate() with the local profile, {t.dtype}, flash-style attention (PyTorch's SDPA)"
                    + (f", the busiest ep rank's {imbalance:.2f}× the mean routed rows (the run's median "
                       "ep_max_over_mean)" if p.ep > 1 else ""),
                    unit="s"))
    return rows


def exposed_rows(cfg: Config, steps: list[dict], est: dict | None, missing: str | None,
                 est_least: dict | None = None) -> list[Row]:
    """Exposed communication per axis beside estimate()'s exposed time of that axis. Measured:
    the seconds a rank was blocked in its collectives and waits; on dp, tp and cp, call by call,
    the least any rank of the group waited, summed over the step's calls
    (``comm_exposed_call_least_s``: the first to arrive also waits for the slowest, which a
    model of balanced ranks leaves out; a metrics file from before it was measured gives the
    least of the ranks' step totals, ``comm_exposed_least_s``), on pp rank 0's (``comm_exposed_s``),
    which waits for its neighbours' compute as well as for the transfers: the schedule's bubble
    is part of what it measured, and of the prediction.

    ``est_least``: the estimate on ``GPU.without_skew()``, beside a least-waiting rank's figure
    (a CPU's calls less the ranks' skew; the same as ``est`` on a GPU); None: ``est``."""
    est_least = est if est_least is None else est_least
    if not all("comm_exposed_s" in step for step in steps):
        return []  # a metrics file written before the engine measured it

    def rank_zero(keys) -> float:
        return statistics.median(sum(step["comm_exposed_s"].get(key, 0.0) for key in keys) for step in steps)

    def least(keys, field: str) -> float | None:
        """The median over steps of the least waits of the groups keyed ``keys``, summed."""
        if not all(k in step.get(field, {}) for step in steps for k in keys):
            return None
        return statistics.median(sum(step[field][k] for k in keys) for step in steps)

    p = cfg.parallel
    # The gradient reduction runs over dp × cp: counted under "dp+cp", or with dp = 1 under "cp"
    # together with the attention's traffic, where one row holds both.
    dp_key = "dp+cp" if p.cp > 1 else "dp"
    # hybrid sharding beside cp: the all-reduce between its groups runs over dp ranks alone, under "dp"
    dp_keys = (dp_key, "dp") if p.dp_shard and p.cp > 1 else (dp_key,)
    cp_alone = ("cp_exposed_s",) if p.dp > 1 else ("cp_exposed_s", "dp_exposed_s")
    why = f"{missing} (under two minutes)" if missing else None
    rows = []
    for axis, size, ledger_keys, predicted_keys, formula in (
            ("dp", p.dp * (p.cp if p.dp > 1 else 1), dp_keys, ("dp_exposed_s",),
             "estimate()'s dp_exposed_s: buckets (ZeRO-3: units; kept gathered, ZeRO-1's buckets) behind the "
             "backward, the rest exposed"),
            ("tp", p.tp, ("tp", "tp.loss", "tp.partial_grads"), ("tp_exposed_s",),
             "estimate()'s tp_exposed_s: each tp collective between its products, the loss's included, and "
             "under SP an MoE model's once-a-step sum of partial gradients"),
            ("cp", p.cp, ("cp",), cp_alone, "estimate()'s cp_exposed_s: what exceeds the attention core"
             + ("" if p.dp > 1 else ", and dp_exposed_s: the gradients' reduction over cp")),
            ("pp", p.pp, ("pp",), ("pp_exposed_s", "rank0_bubble_s"),
             "estimate()'s pp_exposed_s + rank0_bubble_s: rank 0 waits for its neighbours' transfers and compute "
             "(the schedule played at the run's split)")):
        if size == 1:
            continue
        on_rank_zero = rank_zero(ledger_keys)
        groups = dp_keys if axis == "dp" else ledger_keys[:1]  # least_exposed's keys: a group each
        per_call, per_step = ((None, None) if axis == "pp" else
                              (least(groups, "comm_exposed_call_least_s"), least(groups, "comm_exposed_least_s")))
        measured = per_call if per_call is not None else per_step
        beside = est if measured is None else est_least  # rank 0's waits hold the skew; the least's do not
        predicted = None if beside is None else sum(beside[key] for key in predicted_keys)
        skew = "" if beside is est else " (predicted without the ranks' skew: GPU.without_skew)"
        if per_call is not None:
            totals = f"the least rank's step total {per_step:.3f} s, " if per_step is not None else ""
            note = (f"; measured: call by call, the least any rank of the group waited ({totals}"
                    f"rank 0's {on_rank_zero:.3f} s){skew}")
        elif per_step is not None:
            note = f"; measured: the least any rank of the group waited (rank 0 {on_rank_zero:.3f} s){skew}"
        else:
            note = "; measured: rank 0's waits"
        rows.append(Row(f"exposed comm: {axis}", predicted, on_rank_zero if measured is None else measured,
                        why or formula + note, unit="s"))
    return rows


def within_tolerance(row: Row, relative: float = 0.25, absolute_s: float = 0.020) -> bool | None:
    """Whether a time row's prediction is within ``relative`` of the measurement or
    ``absolute_s`` of it, whichever is larger (issue 16's bar for exposed communication)."""
    if row.predicted is None:
        return None
    return abs(row.predicted - row.measured) <= max(relative * row.measured, absolute_s)


def _show(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:.3f} s" if unit == "s" else f"{value:,.0f}"


def rows_table(rows: list[Row], title: str):
    from rich.table import Table

    from rich.console import Group
    from rich.text import Text

    # The formulas are long: numbered notes under the table keep it readable in 80 columns.
    table = Table(title=title)
    for name, justify in (("quantity", "left"), ("predicted", "right"), ("measured", "right"),
                          ("measured/predicted", "right"), ("", "right")):
        table.add_column(name, justify=justify)
    notes: list[str] = []
    for row in rows:
        ratio = "—" if row.ratio is None else ("exact" if row.predicted == row.measured else f"{row.ratio:.3f}")
        if row.formula not in notes:
            notes.append(row.formula)
        table.add_row(row.quantity, _show(row.predicted, row.unit), _show(row.measured, row.unit), ratio,
                      f"[{notes.index(row.formula) + 1}]")
    return Group(table, *(Text(f"[{i}] {note}") for i, note in enumerate(notes, 1)))


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="The TOML config the run trained with.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="The run's overrides (repeatable).")
@click.option("--metrics-file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The run's metrics (threefold train --metrics-file).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def compare(config_path, overrides, metrics_file, as_json):
    """Compare a run's measurements with the planner's prediction."""
    cfg = load_config(config_path, overrides)
    rows = compare_run(cfg, metrics_file)
    if as_json:
        click.echo(json.dumps([row.to_json() for row in rows], indent=2))
        return
    from rich.console import Console

    p = cfg.parallel
    axes = p.sizes_text()
    records = read_records(metrics_file, "--metrics-file")
    warmups = len(records) - len(steady(records))
    measured = ("its one step, warm-up included" if not warmups else "median of steps after the first"
                if warmups == 1 else f"median of steps, without each of its {warmups} launches' first")
    Console().print(rows_table(rows, f"rank 0 of {axes}: predicted vs measured ({measured})"))
    drift = step_time_drift(read_steps(metrics_file))
    if drift:
        (a, b), (c, d) = drift["fast_steps"], drift["slow_steps"]
        click.echo(f"the machine's speed moved during the run: {drift['fast_s']:.3f} s a step over steps {a}-{b}, "
                   f"{drift['slow_s']:.3f} s over steps {c}-{d} ({drift['slow_s'] / drift['fast_s'] - 1:.0%} slower); "
                   "the profile describes one moment of it")
