"""A one-page figure of a stats report (matplotlib, the optional extra ``plot``).

Packed run, 2 x 2: sample lengths per env; sampled tokens per step stacked by env; one step's
load per rank split into its micro-batches (the step given, else the costliest); padding and
packing efficiency per step. Rollout Parquet, 2 x 2: sample lengths per env; groups per env by
signal (uniform all-0 / all-1 / other vs the rest); group sizes per env; sampled vs trainable
tokens per env.

matplotlib is imported here only, and without pyplot: ``figure()`` returns a
``matplotlib.figure.Figure`` drawn on the Agg canvas, so no display or global state is involved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.stats.accumulate import Stats, ValueCounts


class PlotUnavailable(RolltoolError):
    """matplotlib (the optional extra ``plot``) is not installed."""


def _matplotlib() -> Any:
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed",
            hint="pip install 'rolltool[plot]' (or pip install matplotlib)",
        ) from None
    return Figure


def figure_path(path: str | Path) -> Path:
    """The file ``save_figure`` writes: ``path``, with ``.png`` added when it has no suffix
    (what matplotlib itself does; the CLI names the file actually written)."""
    p = Path(path)
    return p if p.suffix else p.with_name(p.name + ".png")


def _colors(names: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(names)}


MAX_LEGEND = 12
"""Micro-batches named in a legend; more get a colour bar."""


def _si(x: float, _pos: Any = None) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{suffix}"
    return f"{x:g}"


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Readable major ticks of a log axis over [lo, hi]: 1-2-5 steps (3 to 8 of them), else
    every decade when that gives too many, else every digit when too few; plain numbers."""
    decades = range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
    ticks: list[float] = []
    for subs in ((1, 2, 5), (1,), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0**d for d in decades for m in subs if lo <= m * 10.0**d <= hi]
        if subs == (1, 2, 5) and 3 <= len(ticks) <= 8:
            return ticks
        if subs == (1,) and len(ticks) >= 3:
            step = -(-len(ticks) // 8)  # at most 8 labels: every 2nd (3rd...) decade
            return ticks[::step]
    if len(ticks) >= 2:
        return ticks[:: -(-len(ticks) // 8)]
    # a narrow range (within one digit of a decade): three round values inside it
    return sorted({float(f"{x:.2g}") for x in np.geomspace(lo, hi, 3)})


def _log_axis(axis: Any, lo: float, hi: float) -> None:
    """``axis`` (x or y, log scale) labelled with ``_log_ticks`` as 1,000-style numbers and
    unlabelled minor ticks."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(FixedLocator(_log_ticks(lo, hi)))
    axis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:,.0f}" if x >= 1 else f"{x:g}"))
    axis.set_minor_locator(LogLocator(base=10, subs=[float(k) for k in range(2, 10)]))
    axis.set_minor_formatter(NullFormatter())


def _integer(axis: Any) -> None:
    """Counts on ``axis``: whole-number ticks only (never 2.5 groups)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _legend_right(ax: Any, **kw: Any) -> None:
    """The legend beside ``ax``, outside it (constrained layout makes room): never over data."""
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), **kw)


def _lengths(ax: Any, lengths: dict[str, ValueCounts], colors: dict[str, Any], title: str) -> None:
    """Step histograms of sample lengths per env on log-spaced bins."""

    nonempty = [vc for vc in lengths.values() if vc.n]
    if not nonempty:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    else:
        lo = max(1, min(int(vc.values[0]) for vc in nonempty))
        hi = max(int(vc.values[-1]) for vc in nonempty)
        bins = np.geomspace(lo, max(hi, lo + 1) * 1.0001, 40)
        for env, vc in lengths.items():
            if not vc.n:
                continue
            counts, _ = np.histogram(vc.values, bins=bins, weights=vc.counts)
            ax.stairs(counts, bins, fill=True, alpha=0.25, color=colors[env])
            p50 = vc.quantile(0.5)
            ax.stairs(counts, bins, lw=1.6, color=colors[env], label=f"{env} (p50 {p50:,})")
        ax.set_xscale("log")
        ax.set_xlim(bins[0], bins[-1])
        _log_axis(ax.xaxis, bins[0], bins[-1])
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
        ax.legend(frameon=False, fontsize=8, loc="best")
    _integer(ax.yaxis)
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_xlabel("sample length (tokens, log scale)")
    ax.set_ylabel("samples")


MAX_CAPACITY_LABELS = 12
"""Up to this many steps, each bar of the row-capacity panel is labelled with its packing
efficiency; more steps get a mean line instead (labels would overlap)."""


def _capacity_floor(efficiency: np.ndarray) -> float:
    """Where the row-capacity panel's axis starts: 10% below the lowest step's efficiency,
    rounded down to a multiple of 10% (0 when a step is below 20%), so that the part that
    differs between steps fills the panel.

    >>> _capacity_floor(np.array([0.83, 0.97])), _capacity_floor(np.array([0.15, 0.9]))
    (0.7, 0.0)
    """
    lowest = float(efficiency.min(initial=1.0))
    return max(0.0, float(np.floor((lowest - 0.1) * 10 + 1e-9)) / 10) if lowest >= 0.2 else 0.0


def _capacity(ax: Any, steps: list[dict[str, Any]], x: np.ndarray, totals: dict[str, Any]) -> None:
    """Row capacity per step as shares of it (real tokens, padding, unused), the axis zoomed on
    the range the steps cover; labels per bar up to `MAX_CAPACITY_LABELS` steps, else a mean."""
    from matplotlib.ticker import PercentFormatter

    cap = np.array([s["row_capacity"] for s in steps], dtype=np.float64)
    cap[cap == 0] = 1.0
    real = np.array([s["real_tokens"] for s in steps], dtype=np.float64) / cap
    pad = np.array([s["padding_tokens"] for s in steps], dtype=np.float64) / cap
    unused = np.maximum(1.0 - real - pad, 0.0)
    many = len(steps) > 60
    bar = {"width": 1.0 if many else 0.85, "linewidth": 0}
    ax.bar(x, real, color="tab:green", alpha=0.8, label="real tokens", **bar)
    ax.bar(x, pad, bottom=real, color="tab:red", label="padding", **bar)
    ax.bar(x, unused, bottom=real + pad, color="0.88", label="unused row capacity", **bar)
    floor = _capacity_floor(real)
    if len(steps) <= MAX_CAPACITY_LABELS:
        for xi, r in zip(x, real, strict=True):
            ax.text(xi, r - 0.01, f"{r:.0%}", ha="center", va="top", fontsize=9, color="white")
    elif totals["packing_efficiency"] is not None:
        run = float(totals["packing_efficiency"])
        ax.axhline(run, color="black", ls="--", lw=1, label=f"whole run {run:.1%}")
    ax.set_ylim(floor, 1.12)  # room for the legend above 100%
    ax.set_yticks([t for t in ax.get_yticks() if floor <= t <= 1.0 + 1e-9])
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_title(
        f"Row capacity per step (packing efficiency {totals['packing_efficiency']:.1%}, "
        f"padding {totals['padding_fraction']:.1%})",
        loc="left",
        fontsize=11,
    )
    ax.set_xlabel(
        "step" if len(steps) > MAX_CAPACITY_LABELS else "step (label: packing efficiency)"
    )
    ax.set_ylabel("share of row capacity" + (f" (axis from {floor:.0%})" if floor else ""))
    ax.legend(frameon=False, fontsize=8, loc="upper left", ncols=4)
    if len(steps) <= 20:
        ax.set_xticks(x)
    else:
        _integer(ax.xaxis)
    if many:
        ax.set_xlim(float(x.min()) - 0.5, float(x.max()) + 0.5)


def _packed_figure(stats: Stats, step: int | None) -> Any:
    from matplotlib.ticker import FuncFormatter

    Figure = _matplotlib()
    rep = stats.report
    steps = rep["steps"]
    envs = list(rep["totals"]["envs"])
    colors = _colors(envs)
    fig = Figure(figsize=(14, 9), layout="constrained")
    (ax_len, ax_tok), (ax_rank, ax_pad) = fig.subplots(2, 2)
    c, world = rep["config"], rep.get("world") or {}
    k = world.get("group_size", 1)
    dp = f"dp {rep['dp']}" + (f" x {'sp' if world['sp'] > 1 else 'cp'} {k}" if k > 1 else "")
    fig.suptitle(
        f"{rep['path']}: {rep['steps_read']} steps, {dp}, balance {c.get('balance')} "
        f"({c.get('align')}), packing efficiency {rep['totals']['packing_efficiency']:.1%}",
        fontsize=13,
    )

    _lengths(ax_len, stats.lengths, colors, "Trained sample lengths per env")

    x = np.array([s["step"] for s in steps])
    bottom = np.zeros(len(steps))
    for env in envs:
        y = np.array([(s["envs"].get(env) or {}).get("sampled_tokens") or 0 for s in steps])
        ax_tok.bar(x, y, bottom=bottom, color=colors[env], label=env, width=0.85)
        bottom += y
    ax_tok.set_title("Sampled tokens per step, by env", loc="left", fontsize=11)
    ax_tok.set_xlabel("step")
    ax_tok.set_ylabel("sampled tokens")
    ax_tok.yaxis.set_major_formatter(FuncFormatter(_si))
    if len(envs) <= 6:  # one row in the room left above the bars
        ax_tok.set_ylim(0, float(bottom.max(initial=1)) * 1.15)
        ax_tok.legend(frameon=False, fontsize=8, loc="upper left", ncols=max(1, len(envs)))
    else:
        _legend_right(ax_tok)
    if len(steps) <= 20:
        ax_tok.set_xticks(x)
    else:
        _integer(ax_tok.xaxis)

    if step is None:  # the costliest step: the one a person asks about
        chosen = max(steps, key=lambda s: s["step_cost"])
    else:
        chosen = next(s for s in steps if s["step"] == step)
    grid = np.array([r["micro_batch_tokens"] for r in chosen["ranks"]], dtype=np.float64)
    ranks = np.arange(grid.shape[0])
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    m = grid.shape[1]
    base = np.zeros(len(ranks))
    shade = [0.15 + 0.7 * j / max(1, m - 1) for j in range(m)]
    bars = []
    for j in range(m):
        bars.append(
            ax_rank.bar(
                ranks,
                grid[:, j],
                bottom=base,
                color=cmap(shade[j]),
                edgecolor="white",
                linewidth=0.6 if m <= 16 else 0.2,
            )
        )
        base += grid[:, j]
    mean_line = None
    if len(ranks):
        mean_line = ax_rank.axhline(base.mean(), color="black", ls="--", lw=1)
        ax_rank.set_ylim(0, float(base.max()) * 1.15)
    ax_rank.set_title(
        f"Step {chosen['step']}: tokens per rank and micro-batch "
        f"(lockstep overhead {chosen['lockstep_overhead']['cost'] - 1:+.1%} in cost)",
        loc="left",
        fontsize=11,
    )
    ax_rank.set_xlabel("data-parallel rank")
    ax_rank.set_ylabel("tokens")
    ax_rank.yaxis.set_major_formatter(FuncFormatter(_si))
    if len(ranks) <= 32:
        ax_rank.set_xticks(ranks)
    else:
        _integer(ax_rank.xaxis)
    if m <= MAX_LEGEND:  # beside the axes, top micro-batch first, as stacked
        handles = ([mean_line] if mean_line is not None else []) + bars[::-1]
        labels = (["mean rank load"] if mean_line is not None else []) + [
            f"micro-batch {j}" for j in range(m - 1, -1, -1)
        ]
        _legend_right(ax_rank, handles=handles, labels=labels)
    else:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import BoundaryNorm, ListedColormap

        listed = ListedColormap([cmap(v) for v in shade])
        norm = BoundaryNorm(np.arange(m + 1) - 0.5, m)
        bar = fig.colorbar(ScalarMappable(norm=norm, cmap=listed), ax=ax_rank, pad=0.01)
        bar.set_label("micro-batch (stacked bottom to top)")
        bar.minorticks_off()
        _integer(bar.ax.yaxis)
        if mean_line is not None:
            ax_rank.legend([mean_line], ["mean rank load"], frameon=False, fontsize=8, loc="upper left")  # fmt: skip

    _capacity(ax_pad, steps, x, rep["totals"])
    return fig


def _rollouts_figure(stats: Stats) -> Any:
    from matplotlib.ticker import FuncFormatter

    Figure = _matplotlib()
    rep = stats.report
    envs = list(rep["envs"])
    colors = _colors(envs)
    fig = Figure(figsize=(14, 9), layout="constrained")
    (ax_len, ax_sig), (ax_size, ax_tok) = fig.subplots(2, 2)
    o = rep["overall"]
    fig.suptitle(
        f"{rep['rows']:,} rollout rows: {o['groups']:,} groups, {o['rollouts']:,} rollouts, "
        f"{o['sampled_tokens']['total']:,} tokens",
        fontsize=13,
    )
    _lengths(ax_len, stats.lengths, colors, "Sample lengths per env")

    y = np.arange(len(envs))
    parts = [
        ("all 0", "#d7301f", lambda e: e["uniform_groups"]["all_0"]),
        ("all 1", "#fc8d59", lambda e: e["uniform_groups"]["all_1"]),
        ("other uniform", "#fdcc8a", lambda e: e["uniform_groups"]["other"]),
        ("with signal", "#6a51a3", lambda e: e["groups"] - e["uniform_groups"]["total"]),
    ]
    left = np.zeros(len(envs))
    for label, color, get in parts:
        w = np.array([get(rep["envs"][e]) for e in envs], dtype=np.float64)
        ax_sig.barh(y, w, left=left, color=color, label=label)
        left += w
    for i, e in enumerate(envs):
        share = rep["envs"][e]["uniform_groups"]["share"]
        if share is not None:
            ax_sig.text(left[i], i, f"  {share:.0%} no signal", va="center", fontsize=9)
    ax_sig.set_yticks(y, envs)
    ax_sig.invert_yaxis()
    ax_sig.set_xlim(0, max(left.max(initial=1) * 1.3, 1))
    ax_sig.set_title("Groups per env: uniform rewards carry no gradient", loc="left", fontsize=11)
    ax_sig.set_xlabel("groups")
    ax_sig.set_ylabel("env")
    _integer(ax_sig.xaxis)
    _legend_right(ax_sig)

    sizes = sorted({int(k) for e in envs for k in rep["envs"][e]["group_size"]["counts"]})
    width = 0.8 / max(1, len(envs))
    xs = np.arange(len(sizes))
    for i, e in enumerate(envs):
        counts = rep["envs"][e]["group_size"]["counts"]
        ax_size.bar(
            xs + (i - (len(envs) - 1) / 2) * width,
            [counts.get(str(s), 0) for s in sizes],
            width=width,
            color=colors[e],
            label=e,
        )
    ax_size.set_xticks(xs, [str(s) for s in sizes])
    ax_size.set_title("Group sizes per env", loc="left", fontsize=11)
    ax_size.set_xlabel("rollouts per group")
    ax_size.set_ylabel("groups")
    _integer(ax_size.yaxis)
    ax_size.set_ylim(0, ax_size.get_ylim()[1] * 1.15)
    ax_size.legend(frameon=False, fontsize=8, loc="upper left", ncols=max(1, min(len(envs), 6)))

    xe = np.arange(len(envs))
    sampled = [rep["envs"][e]["sampled_tokens"]["total"] for e in envs]
    trainable = [rep["envs"][e]["trainable_tokens"]["total"] for e in envs]
    ax_tok.bar(xe - 0.2, sampled, width=0.4, color=[colors[e] for e in envs], alpha=0.45)
    ax_tok.bar(xe + 0.2, trainable, width=0.4, color=[colors[e] for e in envs])
    for i in range(len(envs)):
        if sampled[i]:
            ax_tok.text(xe[i] + 0.2, trainable[i], f"{trainable[i] / sampled[i]:.0%}", ha="center", va="bottom", fontsize=9)  # fmt: skip
    ax_tok.set_xticks(xe, envs)
    ax_tok.yaxis.set_major_formatter(FuncFormatter(_si))
    ax_tok.set_title("Tokens per env: sampled (pale) and trainable", loc="left", fontsize=11)
    ax_tok.set_xlabel("env")
    ax_tok.set_ylabel("tokens")
    return fig


def figure(stats: Stats, *, step: int | None = None) -> Any:
    """The one-page ``matplotlib.figure.Figure`` of ``stats`` (rollout Parquet or packed run).
    Raises `PlotUnavailable` before any drawing when matplotlib is missing."""
    _matplotlib()
    if stats.report["kind"] == "packed":
        return _packed_figure(stats, step)
    return _rollouts_figure(stats)


def save_figure(stats: Stats, path: str | Path, *, step: int | None = None) -> Path:
    """Draw ``figure(stats)`` into ``path`` (PNG, or any format matplotlib knows by suffix; no
    suffix: PNG, ``.png`` added) and return the path written."""
    fig = figure(stats, step=step)
    p = figure_path(path)
    try:
        fig.savefig(p, dpi=110)
    except (OSError, ValueError) as e:
        raise RolltoolError(f"{p}: could not write the figure ({e})") from None
    return p
