"""Rich tables of a stats report: numbers right-aligned with thousands separators.

``render(report, per_step=..., step=...)`` returns renderables; the CLI prints them. Tables of
rollout Parquet have one column per env (and "all"), so they stay narrow however many metrics
there are; tables of a packed run have one row per figure, env, split or step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from rolltool.stats.packed import ALTERNATIVES


def _int(x: Any) -> str:
    return "-" if x is None else f"{round(x):,}"


def _num(x: Any, spec: str = ",.1f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.1%}"


def _over(x: Any) -> str:
    """A ratio to the ideal (1.0 = perfect) as the percentage above it."""
    return "-" if x is None else f"{x - 1:+.2%}"


def _table(title: str, columns: Iterable[str], first_left: bool = True) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 and first_left else "right", no_wrap=i == 0)
    return t


# rollout Parquet: (label, getter, formatter); a None label starts a new section
ROLLOUT_ROWS: list[tuple[str | None, str | tuple[str, ...], Any]] = [
    ("groups", "groups", _int),
    ("usual group size", "group_size.usual", _int),
    ("groups of another size", "group_size.odd_size_groups", _int),
    ("rollouts", "rollouts", _int),
    ("samples", "samples", _int),
    ("branches per rollout (mean)", "branches_per_rollout.mean", lambda x: _num(x, ".2f")),
    ("branches per rollout (max)", "branches_per_rollout.max", _int),
    (None, "", None),
    ("sampled tokens", "sampled_tokens.total", _int),
    ("  mean length", "sampled_tokens.mean", _int),
    ("  p50 / p90", ("sampled_tokens.p50", "sampled_tokens.p90"), _int),
    ("  p99 / max", ("sampled_tokens.p99", "sampled_tokens.max"), _int),
    ("trainable tokens", "trainable_tokens.total", _int),
    ("  mean per sample", "trainable_tokens.mean", _int),
    ("  p50 / p90", ("trainable_tokens.p50", "trainable_tokens.p90"), _int),
    ("  p99 / max", ("trainable_tokens.p99", "trainable_tokens.max"), _int),
    (None, "", None),
    ("reward mean", "reward.mean", lambda x: _num(x, ".3f")),
    ("reward std", "reward.std", lambda x: _num(x, ".3f")),
    ("uniform groups (no signal)", "uniform_groups.total", _int),
    ("  share of groups", "uniform_groups.share", _pct),
    ("  all 0 / all 1 / other", ("uniform_groups.all_0", "uniform_groups.all_1", "uniform_groups.other"), _int),
]  # fmt: skip

COMPLETION_ROWS: list[tuple[str | None, str | tuple[str, ...], Any]] = [
    (None, "", None),
    ("groups completing out of order", "completion.out_of_order_groups", _int),
    ("  share", "completion.out_of_order_share", _pct),
    ("rank displacement mean / max", ("completion.displacement.mean", "completion.displacement.max"), lambda x: _num(x, ",.1f")),
    ("input vs completion order (Spearman)", "completion.rank_correlation", lambda x: _num(x, ".2f")),
    ("completion span (s)", "completion.span_s", _num),
    ("group wait p50 / p90 (s)", ("completion.group_wait_s.p50", "completion.group_wait_s.p90"), _num),
]  # fmt: skip


def _get(d: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _cell(section: dict[str, Any], key: str | tuple[str, ...], fmt: Any) -> str:
    if isinstance(key, tuple):
        return " / ".join(fmt(_get(section, k)) for k in key)
    return fmt(_get(section, key))


def render_rollouts(report: dict[str, Any]) -> list[RenderableType]:
    envs: dict[str, Any] = report["envs"]
    scopes = list(envs.items()) + ([("all", report["overall"])] if len(envs) > 1 else [])
    files = len(report["inputs"])
    title = f"rollouts: {report['rows']:,} rows from {files:,} file{'s' * (files != 1)}"
    if report.get("limit"):
        title += f" (--limit {report['limit']:,})"
    t = _table(title, ["", *(name for name, _ in scopes)])
    rows = ROLLOUT_ROWS + (COMPLETION_ROWS if report["overall"].get("completion") else [])
    for label, key, fmt in rows:
        if label is None:
            t.add_section()
            continue
        t.add_row(label, *(_cell(s, key, fmt) for _, s in scopes))
    return [t]


def _header(report: dict[str, Any]) -> Text:
    c = report["config"]
    budget = (
        f"{c['micro_batch_tokens']:,} tokens per micro-batch"
        if c.get("micro_batch_tokens")
        else f"{c.get('micro_batch_size')} samples per micro-batch"
    )
    row = f", rows padded to {c['row_len']:,}" if c.get("row_len") else ""
    read = report["steps_read"]
    steps = f"{read:,} of {report['num_steps']:,}" if read != report["num_steps"] else f"{read:,}"
    return Text.assemble(
        ("packed run ", "bold"),
        f"{report['path']}: {steps} steps of {c.get('batch_size')} {c.get('batch_unit')}, "
        f"dp {report['dp']}, {budget}{row}\n",
        f"balance {c.get('balance')} ({report['workload']['describe']}), align {c.get('align')}",
    )


def _run_table(report: dict[str, Any]) -> Table:
    tot, across = report["totals"], report["across_steps"]
    t = _table("per step", ["", "total", "mean", "p50", "p90", "min", "max"])
    for label, key, fmt in (
        ("samples", "samples", _int),
        ("sampled tokens", "sampled_tokens", _int),
        ("trainable tokens", "trainable_tokens", _int),
        ("micro-batches per rank", "micro_batches_per_rank", lambda x: _num(x, ",.1f")),
        ("packing efficiency", "packing_efficiency", _pct),
        ("padding", "padding_fraction", _pct),
        ("rank imbalance (cost)", "rank_imbalance.cost", _over),
        ("rank imbalance (tokens)", "rank_imbalance.tokens", _over),
        ("lockstep overhead (cost)", "lockstep_overhead.cost", _over),
        ("lockstep overhead (tokens)", "lockstep_overhead.tokens", _over),
    ):
        a = across[key]
        total = _get(tot, key) if "." not in key else None
        t.add_row(label, fmt(total) if total is not None else "", *(fmt(a[k]) for k in ("mean", "p50", "p90", "min", "max")))  # fmt: skip
    t.add_section()
    t.add_row("groups (uniform kept / dropped)", f"{tot['groups']:,} ({tot['uniform_groups_kept']:,} / {tot['uniform_groups_dropped']:,})", *[""] * 5)  # fmt: skip
    t.add_row("rollouts", _int(tot["rollouts"]), *[""] * 5)
    t.add_row("over-long samples dropped", _int(tot["overlong_dropped"]), *[""] * 5)
    t.add_row("rows (padding tokens)", f"{tot['rows']:,} ({tot['padding_tokens']:,})", *[""] * 5)
    return t


def _env_table(title: str, envs: dict[str, Any]) -> Table:
    t = _table(title, ["env", "groups", "rollouts", "samples", "sampled tokens", "trainable tokens", "token share", "loss weight share", "uniform kept / dropped"])  # fmt: skip
    for env, e in envs.items():
        t.add_row(
            env,
            _int(e["groups"]),
            _int(e["rollouts"]),
            _int(e["samples"]),
            _int(e["sampled_tokens"]),
            _int(e["trainable_tokens"]),
            _pct(e["token_share"]),
            _pct(e["loss_weight_share"]),
            f"{_int(e['uniform_groups_kept'])} / {_int(e['uniform_groups_dropped'])}",
        )
    return t


def _balance_table(title: str, chosen: str, rows: dict[str, Any]) -> Table:
    t = _table(title, ["split", "micro-batches / rank", "rank imbalance (cost)", "lockstep overhead (cost)", "rank imbalance (tokens)", "lockstep overhead (tokens)", "step time vs chosen"])  # fmt: skip
    for name, b in rows.items():
        if b is None:
            t.add_row(name, *["-"] * 6)
            continue
        vs = b.get("step_cost_vs_chosen", 1.0 if name.startswith(chosen) else None)
        t.add_row(
            name,
            _num(b["micro_batches_per_rank"], ",.1f"),
            _over(b["rank_imbalance"]["cost"]),
            _over(b["lockstep_overhead"]["cost"]),
            _over(b["rank_imbalance"]["tokens"]),
            _over(b["lockstep_overhead"]["tokens"]),
            _over(vs),
        )
    return t


def _fill_table(hist: list[int]) -> Table:
    t = _table("micro-batch token fill", ["fill", "micro-batches", ""])
    top = max(hist) or 1
    for i, n in enumerate(hist):
        t.add_row(f"{i * 10:>3}-{(i + 1) * 10}%", _int(n), "█" * round(24 * n / top))
    return t


def _steps_table(steps: list[dict[str, Any]]) -> Table:
    cols = ["step", "status", "groups", "rollouts", "samples", "sampled tokens", "trainable tokens", "uniform dropped", "mb / rank", "packing eff.", "padding", "rank imb. (cost)", "lockstep ovh. (cost)", *(f"{k} split vs" for k in ALTERNATIVES)]  # fmt: skip
    t = _table("steps", cols, first_left=False)
    for s in steps:
        alts = s.get("alternatives") or {}
        t.add_row(
            str(s["step"]),
            str(s["status"]),
            _int(s["groups"]),
            _int(s["rollouts"]),
            _int(s["samples"]),
            _int(s["sampled_tokens"]),
            _int(s["trainable_tokens"]),
            _int(s["uniform_groups_dropped"]),
            _int(s["micro_batches_per_rank"]),
            _pct(s["packing_efficiency"]),
            _pct(s["padding_fraction"]),
            _over(s["rank_imbalance"]["cost"]),
            _over(s["lockstep_overhead"]["cost"]),
            *(_over((alts.get(k) or {}).get("step_cost_vs_chosen")) for k in ALTERNATIVES),
        )
    return t


def _rank_table(s: dict[str, Any]) -> Table:
    t = _table(f"step {s['step']}: ranks", ["rank", "micro-batches", "samples", "row tokens", "real tokens", "cost share", "tokens per micro-batch"])  # fmt: skip
    total = sum(r["cost"] for r in s["ranks"]) or 1.0
    for r in s["ranks"]:
        t.add_row(
            str(r["rank"]),
            _int(r["micro_batches"]),
            _int(r["samples"]),
            _int(r["row_tokens"]),
            _int(r["real_tokens"]),
            _pct(r["cost"] / total),
            " ".join(f"{x:,}" for x in r["micro_batch_tokens"]),
        )
    return t


def render_packed(
    report: dict[str, Any], *, per_step: bool = False, step: int | None = None
) -> list[RenderableType]:
    chosen = report["config"].get("balance") or "chosen"
    bal = dict(report["totals"]["balance"])
    rows: dict[str, Any] = {f"{chosen} (chosen)": bal.pop("chosen"), **bal}
    title = "balance: the chosen split vs a token or count split (mean over steps)"
    out: list[RenderableType] = [
        _header(report),
        _run_table(report),
        _env_table("envs (all steps)", report["totals"]["envs"]),
        _balance_table(title, chosen, rows),
        _fill_table(report["totals"]["fill_histogram"]),
    ]
    if per_step:
        out.append(_steps_table(report["steps"]))
    if step is not None:
        s = next(x for x in report["steps"] if x["step"] == step)
        if not per_step:
            out.append(_steps_table([s]))
        out.append(_env_table(f"step {s['step']}: envs", s["envs"]))
        alt = s.get("alternatives") or {}
        me = {k: s[k] for k in ("micro_batches_per_rank", "rank_imbalance", "lockstep_overhead")}
        out.append(_balance_table(f"step {s['step']}: balance", chosen, {f"{chosen} (chosen)": me, **alt}))  # fmt: skip
        out.append(_rank_table(s))
    return out


def render(
    report: dict[str, Any], *, per_step: bool = False, step: int | None = None
) -> RenderableType:
    """All tables of a report (rollout Parquet or packed run) as one renderable."""
    if report["kind"] == "packed":
        parts = render_packed(report, per_step=per_step, step=step)
    else:
        parts = render_rollouts(report)
    spaced: list[RenderableType] = []
    for p in parts:
        spaced.extend([p, Text("")])
    return Group(*spaced[:-1])
