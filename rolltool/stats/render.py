"""Rich tables of a stats report, and of pack's and advantages' reports: numbers right-aligned
with thousands separators, every figure formatted by ``rolltool.util.numfmt`` (rank imbalance and
lockstep overhead read ``+1.23%`` above the ideal, in stats and in pack alike).

``render(report, per_step=..., step=..., width=...)`` returns renderables; the CLI prints them.
``render_pack(manifest, output)`` and ``render_advantages(report)`` are the tables those commands
print, sized the same way.
Tables of rollout Parquet have one column per env (and "(all)", which no env name can take), so
they stay narrow however many metrics there are; tables of a packed run have one row per figure,
env, split or step.

Sized to ``width`` (the terminal): a table wider than it first switches to short, two-line
headers, then hides its least important columns (saying which in a caption), and the rollout
table splits its env columns over several tables; numbers are never cut. ``width=None`` (or a
wide console: piped output is 160 columns) keeps every column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from rolltool.format import Manifest, StepCounts, StepRecord
from rolltool.plan.minibatches import recorded_structure
from rolltool.stats.packed import ALTERNATIVES, COUNTS, env_totals, world_layout
from rolltool.util.numfmt import count, num, over, pct
from rolltool.util.tables import Col, fit, natural_width, new_table

ALL = "(all)"
"""The column of all envs together in the rollout table (an env may be named "all")."""


# rollout Parquet: (label, getter, formatter); a None label starts a new section
ROLLOUT_ROWS: list[tuple[str | None, str | tuple[str, ...], Any]] = [
    ("groups", "groups", count),
    ("usual group size", "group_size.usual", count),
    ("groups of another size", "group_size.odd_size_groups", count),
    ("rollouts", "rollouts", count),
    ("samples", "samples", count),
    ("branches per rollout (mean)", "branches_per_rollout.mean", lambda x: num(x, ".2f")),
    ("branches per rollout (max)", "branches_per_rollout.max", count),
    (None, "", None),
    ("sampled tokens", "sampled_tokens.total", count),
    ("  mean length", "sampled_tokens.mean", count),
    ("  p50 / p90", ("sampled_tokens.p50", "sampled_tokens.p90"), count),
    ("  p99 / max", ("sampled_tokens.p99", "sampled_tokens.max"), count),
    ("trainable tokens", "trainable_tokens.total", count),
    ("  mean per sample", "trainable_tokens.mean", count),
    ("  p50 / p90", ("trainable_tokens.p50", "trainable_tokens.p90"), count),
    ("  p99 / max", ("trainable_tokens.p99", "trainable_tokens.max"), count),
    (None, "", None),
    ("reward mean", "reward.mean", lambda x: num(x, ".3f")),
    ("reward std", "reward.std", lambda x: num(x, ".3f")),
    ("uniform groups (no signal)", "uniform_groups.total", count),
    ("  share of groups", "uniform_groups.share", pct),
    ("  all 0 / all 1 / other", ("uniform_groups.all_0", "uniform_groups.all_1", "uniform_groups.other"), count),
]  # fmt: skip

COMPLETION_ROWS: list[tuple[str | None, str | tuple[str, ...], Any]] = [
    (None, "", None),
    ("groups completing out of order", "completion.out_of_order_groups", count),
    ("  share", "completion.out_of_order_share", pct),
    ("rank displacement mean / max", ("completion.displacement.mean", "completion.displacement.max"), lambda x: num(x, ",.1f")),
    ("input vs completion order (Spearman)", "completion.rank_correlation", lambda x: num(x, ".2f")),
    ("completion span (s)", "completion.span_s", num),
    ("group wait p50 / p90 (s)", ("completion.group_wait_s.p50", "completion.group_wait_s.p90"), num),
]  # fmt: skip


def _get(d: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _cell(section: dict[str, Any], key: str | tuple[str, ...], fmt: Any) -> str:
    if isinstance(key, tuple):
        return " / ".join(fmt(_get(section, k)) for k in key)
    return fmt(_get(section, key))


def render_rollouts(report: dict[str, Any], width: int | None = None) -> list[RenderableType]:
    envs: dict[str, Any] = report["envs"]
    scopes = list(envs.items()) + ([(ALL, report["overall"])] if len(envs) > 1 else [])
    files = len(report["inputs"])
    title = f"rollouts: {report['rows']:,} rows from {files:,} file{'s' * (files != 1)}"
    if report.get("limit"):
        title += f" (--limit {report['limit']:,}, to the end of its last group)"
    rows = ROLLOUT_ROWS + (COMPLETION_ROWS if report["overall"].get("completion") else [])

    def table(part: list[tuple[str, Any]], title: str) -> Table:
        t = new_table(title, ["", *(name for name, _ in part)])
        for label, key, fmt in rows:
            if label is None:
                t.add_section()
                continue
            t.add_row(label, *(_cell(s, key, fmt) for _, s in part))
        return t

    # too wide for the terminal: the env columns over several tables, each with the labels
    per = len(scopes)
    t = table(scopes, title)
    while width is not None and per > 1 and natural_width(t) > width:
        per -= 1
        t = table(scopes[:per], title)
    if per == len(scopes):
        return [t]
    chunks = [scopes[i : i + per] for i in range(0, len(scopes), per)]
    return [
        table(c, f"{title}, envs {i * per + 1}-{i * per + len(c)} of {len(scopes)}")
        for i, c in enumerate(chunks)
    ]


def _split(world: dict[str, Any] | None) -> tuple[str, int] | None:
    """("sp" or "cp", k) when each data-parallel rank is a group of k > 1 GPUs, else None."""
    if not world or world.get("group_size", 1) <= 1:
        return None
    return ("sp", world["sp"]) if world["sp"] > 1 else ("cp", world["cp"])


def world_line(world: dict[str, Any]) -> str:
    """The world of an sp/cp pack in words (`rolltool.stats.packed.world_layout`'s dict).

    >>> world_line({"dp": 2, "sp": 2, "cp": 1, "group_size": 2, "gpus": 4, "gpu_budget": 32768,
    ...             "group_budget": 65536, "row_len": None, "group_row_len": None})
    'dp 2 x sp 2 = 4 GPUs; 32,768 tokens per GPU, 65,536 per group micro-batch'
    """
    kind, k = _split(world) or ("", 1)
    shown = f"hybrid {kind}" if world.get("hybrid_cp") else kind  # --hybrid-cp: a degree per sample
    text = f"dp {world['dp']} x {shown} {k} = {world['gpus']:,} GPUs"
    if world.get("gpu_budget"):
        text += (f"; {world['gpu_budget']:,} tokens per GPU, {world['group_budget']:,} per group "
                 f"micro-batch{' (CP padding counted)' if kind == 'cp' else ''}")  # fmt: skip
    if world.get("row_len"):
        text += f"; rows of {world['row_len']:,} per GPU ({world['group_row_len']:,} per group)"
    return text


def step_label(
    step: int, batch: int | None, epoch: int | None, mini_batch: int | None, structured: bool
) -> str:
    """A step's cell: its number, and in a run with --mini-batches/--epochs (``structured``)
    where it comes from, e.g. ``13 (b3 e1 m1)`` (batch 3, epoch 1, mini-batch 1)."""
    if not structured or batch is None:
        return str(step)
    return f"{step} (b{batch} e{epoch or 0} m{mini_batch or 0})"


def structure(epochs: int, mini_batches: int) -> str:
    """How batches became optimizer steps (``--epochs``/``--mini-batches``), or ''."""
    e, m = epochs, mini_batches
    if e * m == 1:
        return ""
    parts = [f"{e} epochs"] * (e > 1) + [f"{m} mini-batches"] * (m > 1)
    return f" (each batch: {' x '.join(parts)})"


def _header(report: dict[str, Any]) -> Text:
    """What was packed and how: steps, dp and budget (with sp/cp a line of the world, both
    budgets), balance and alignment."""
    c = report["config"]
    budget = (
        f"{c['micro_batch_tokens']:,} tokens per micro-batch"
        if c.get("micro_batch_tokens")
        else f"{c.get('micro_batch_size')} samples per micro-batch"
    )
    row = f", rows padded to {c['row_len']:,}" if c.get("row_len") else ""
    read = report["steps_read"]
    steps = f"{read:,} of {report['num_steps']:,}" if read != report["num_steps"] else f"{read:,}"
    head = f"{report['path']}: {steps} steps of {c.get('batch_size')} {c.get('batch_unit')}"
    ppo = structure(c["epochs"], c["mini_batches"])
    if ppo:
        head = (f"{report['path']}: {steps} optimizer steps from batches of {c.get('batch_size')} "
                f"{c.get('batch_unit')}{ppo}")  # fmt: skip
    world = report.get("world")
    if world is not None and _split(world) is not None:  # the world, both budgets: a line
        fixed = "" if c.get("micro_batch_tokens") else f", {budget}"
        head += f"{fixed}\n{world_line(world)}\n"
    else:
        head += f", dp {report['dp']}, {budget}{row}\n"
    return Text.assemble(
        ("packed run ", "bold"),
        head,
        f"balance {c.get('balance')} ({report['workload']['describe']}), align {c.get('align')}",
    )


RUN_ROWS: list[tuple[str, str, Any]] = [
    ("samples", "samples", count),
    ("sampled tokens", "sampled_tokens", count),
    ("trainable tokens", "trainable_tokens", count),
    ("micro-batches per rank", "micro_batches_per_rank", lambda x: num(x, ",.1f")),
    ("packing efficiency", "packing_efficiency", pct),
    ("padding", "padding_fraction", pct),
    ("rank imbalance (cost)", "rank_imbalance.cost", over),
    ("rank imbalance (tokens)", "rank_imbalance.tokens", over),
    ("lockstep overhead (cost)", "lockstep_overhead.cost", over),
    ("lockstep overhead (tokens)", "lockstep_overhead.tokens", over),
]
"""The per-step figures of the run table: (label, key, formatter)."""

OVER_GPU_ROW = ("  over the per-GPU budget (split)", "over_gpu_budget", count)
"""After "samples" with sp/cp: samples trained only because the group split them."""

CP_PADDING_ROW = ("  of which CP padding", "cp_padding_fraction", pct)
"""After "padding" with cp: the samples' padding to a multiple of 2·cp."""


def _run_rows(report: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """`RUN_ROWS`, with the split's rows when the pack has sp or cp."""
    world = report.get("world") or {}
    split = _split(world)
    after: dict[str, tuple[str, str, Any]] = {}
    if split is not None and world.get("gpu_budget"):
        after["samples"] = OVER_GPU_ROW
    if split is not None and split[0] == "cp":
        after["padding_fraction"] = CP_PADDING_ROW
    rows = []
    for row in RUN_ROWS:
        rows.extend([row, after[row[1]]] if row[1] in after else [row])
    return rows


def _run_table(report: dict[str, Any], width: int | None) -> Table:
    tot, across = report["totals"], report["across_steps"]
    cols = [
        Col("", left=True),
        Col("total"),
        Col("mean"),
        Col("p50", keep=2),
        Col("p90", keep=3),
        Col("min", keep=1),
        Col("max", keep=4),
    ]
    rows: list[list[str] | None] = []
    for label, key, fmt in _run_rows(report):
        a = across[key]
        total = _get(tot, key) if "." not in key else None
        rows.append([label, fmt(total) if total is not None else "", *(fmt(a[k]) for k in ("mean", "p50", "p90", "min", "max"))])  # fmt: skip
    rows.append(None)
    rows.append(["groups (uniform kept / dropped)", f"{tot['groups']:,} ({tot['uniform_groups_kept']:,} / {tot['uniform_groups_dropped']:,})", *[""] * 5])  # fmt: skip
    rows.append(["rollouts", count(tot["rollouts"]), *[""] * 5])
    rows.append(["over-long samples dropped", count(tot["overlong_dropped"]), *[""] * 5])
    rows.append(["rows (padding tokens)", f"{tot['rows']:,} ({tot['padding_tokens']:,})", *[""] * 5])  # fmt: skip
    if (_split(report.get("world")) or ("",))[0] == "cp":
        rows.append(["  CP padding tokens", count(tot["cp_padding_tokens"]), *[""] * 5])
    return fit("per step", cols, rows, width)


ENV_COLS = [
    Col("env", left=True),
    Col("groups", keep=3),
    Col("rollouts", keep=2),
    Col("samples", keep=4),
    Col("sampled tokens", "sampled\ntokens"),
    Col("trainable tokens", "trainable\ntokens", keep=5),
    Col("token share", "token\nshare"),
    Col("loss weight share", "loss\nweight"),
    Col("uniform kept / dropped", "uniform\nkept/drop", keep=1),
]


OVER_GPU_COL = Col("over GPU budget", "over GPU\nbudget", keep=2)
"""With sp/cp: trained samples longer than the per-GPU budget (the group split them)."""


def _env_table(title: str, envs: dict[str, Any], width: int | None, split: bool = False) -> Table:
    """Per env: counts and shares; ``split``: with the over-GPU-budget column (sp/cp)."""
    rows = [
        [
            env,
            count(e["groups"]),
            count(e["rollouts"]),
            count(e["samples"]),
            count(e["sampled_tokens"]),
            count(e["trainable_tokens"]),
            pct(e["token_share"]),
            pct(e["loss_weight_share"]),
            f"{count(e['uniform_groups_kept'])} / {count(e['uniform_groups_dropped'])}",
            *([count(e.get("over_gpu_budget"))] if split else []),
        ]
        for env, e in envs.items()
    ]
    return fit(title, [*ENV_COLS, *([OVER_GPU_COL] if split else [])], rows, width)


BALANCE_COLS = [
    Col("split", left=True),
    Col("micro-batches / rank", "mb /\nrank", keep=1),
    Col("rank imbalance (cost)", "rank imb.\n(cost)"),
    Col("lockstep overhead (cost)", "lockstep\n(cost)"),
    Col("rank imbalance (tokens)", "rank imb.\n(tokens)", keep=2),
    Col("lockstep overhead (tokens)", "lockstep\n(tokens)", keep=3),
    Col("step time vs chosen", "step time\nvs chosen"),
]


def _balance_table(title: str, chosen: str, splits: dict[str, Any], width: int | None) -> Table:
    rows: list[list[str] | None] = []
    for name, b in splits.items():
        if b is None:
            rows.append([name, *["-"] * 6])
            continue
        vs = b.get("step_cost_vs_chosen", 1.0 if name.startswith(chosen) else None)
        rows.append(
            [
                name,
                num(b["micro_batches_per_rank"], ",.1f"),
                over(b["rank_imbalance"]["cost"]),
                over(b["lockstep_overhead"]["cost"]),
                over(b["rank_imbalance"]["tokens"]),
                over(b["lockstep_overhead"]["tokens"]),
                over(vs),
            ]
        )
    return fit(title, BALANCE_COLS, rows, width)


def _hybrid_table(h: dict[str, Any], width: int | None) -> Table:
    """A --hybrid-cp run: samples and tokens at each CP degree k (1: whole on one GPU), and the
    balance over every GPU (`rolltool.stats.packed`'s ``totals.hybrid``)."""
    title = (f"hybrid CP: samples per degree; every GPU's lockstep overhead "
             f"{over(h['gpu_lockstep_overhead'])}")  # fmt: skip
    t = Table(title=title, title_justify="left", width=width)
    for name in ("k", "samples", "tokens", "token share"):
        t.add_column(name, justify="right")
    total = sum(h["split_tokens"].values()) or 1
    for k, n in h["split_samples"].items():
        tokens = h["split_tokens"][k]
        t.add_row(k, f"{n:,}", f"{tokens:,}", pct(tokens / total))
    return t


def _shared_table(sh: dict[str, Any], width: int | None) -> Table:
    """A --share-prefix run: tokens per env unshared, stored and saved
    (`rolltool.stats.shared`'s ``totals.shared``), attention pairs and gathered K/V in the title."""
    title = (f"shared prefixes: {sh['prefixes']:,} stored once; attention pairs "
             f"{sh['attention_ratio']:.2f}x fewer, {sh['kv_tokens']:,} keys/values gathered")  # fmt: skip
    t = Table(title=title, title_justify="left", width=width)
    for name in ("env", "tokens unshared", "stored", "saved", "fewer"):
        t.add_column(name, justify="left" if name == "env" else "right")
    rows = [*sh["envs"].items(), ("all", sh)]
    for env, e in rows:
        ratio = e["tokens"] / e["stored"] if e["stored"] else 1.0
        saved = pct(e["saved"] / e["tokens"]) if e["tokens"] else "-"
        t.add_row(env, f"{e['tokens']:,}", f"{e['stored']:,}", saved, f"{ratio:.2f}x")
    return t


def _shared_steps_table(steps: list[dict[str, Any]], width: int | None) -> Table:
    """A --share-prefix run per step and env: tokens unshared, stored and saved."""
    t = Table(title="shared prefixes per step and env", title_justify="left", width=width)
    for name in ("step", "env", "prefixes", "tokens unshared", "stored", "saved"):
        t.add_column(name, justify="left" if name == "env" else "right")
    for st in steps:
        sh = st.get("shared")
        if sh is None:
            continue
        for env, e in sh["envs"].items():
            saved = pct(e["saved"] / e["tokens"]) if e["tokens"] else "-"
            t.add_row(str(st["step"]), env, "", f"{e['tokens']:,}", f"{e['stored']:,}", saved)
        saved = pct(sh["saved"] / sh["tokens"]) if sh["tokens"] else "-"
        t.add_row(str(st["step"]), "all", f"{sh['prefixes']:,}", f"{sh['tokens']:,}",
                  f"{sh['stored']:,}", saved)  # fmt: skip
    return t


def _fill_table(hist: list[int]) -> Table:
    t = new_table("micro-batch token fill", ["fill", "micro-batches", ""])
    top = max(hist) or 1
    for i, n in enumerate(hist):
        t.add_row(f"{i * 10:>3}-{(i + 1) * 10}%", count(n), "█" * round(24 * n / top))
    return t


STEP_COLS = [
    Col("step"),
    Col("status", keep=2),
    Col("groups", keep=3),
    Col("rollouts", keep=1),
    Col("samples", keep=6),
    Col("sampled tokens", "sampled\ntokens"),
    Col("trainable tokens", "trainable\ntokens", keep=5),
    Col("uniform dropped", "uniform\ndropped", keep=4),
    Col("mb / rank", "mb /\nrank", keep=7),
    Col("packing eff.", "packing\neff."),
    Col("padding", keep=8),
    Col("rank imb. (cost)", "rank imb.\n(cost)", keep=9),
    Col("lockstep ovh. (cost)", "lockstep\n(cost)"),
    *(Col(f"{k} split vs", f"{k}\nsplit vs", keep=10) for k in ALTERNATIVES),
]


def _steps_table(
    steps: list[dict[str, Any]], width: int | None, split: bool = False, structured: bool = False
) -> Table:
    """One row per step; ``split``: with the over-GPU-budget column after "samples" (sp/cp);
    ``structured``: steps labelled with their batch, epoch and mini-batch."""
    rows: list[list[str] | None] = []
    for s in steps:
        alts = s.get("alternatives") or {}
        rows.append(
            [
                step_label(
                    s["step"], s.get("batch"), s.get("epoch"), s.get("mini_batch"), structured
                ),
                str(s["status"]),
                count(s["groups"]),
                count(s["rollouts"]),
                count(s["samples"]),
                *([count(s.get("over_gpu_budget"))] if split else []),
                count(s["sampled_tokens"]),
                count(s["trainable_tokens"]),
                count(s["uniform_groups_dropped"]),
                count(s["micro_batches_per_rank"]),
                pct(s["packing_efficiency"]),
                pct(s["padding_fraction"]),
                over(s["rank_imbalance"]["cost"]),
                over(s["lockstep_overhead"]["cost"]),
                *(over((alts.get(k) or {}).get("step_cost_vs_chosen")) for k in ALTERNATIVES),
            ]
        )
    cols = [*STEP_COLS[:5], *([OVER_GPU_COL] if split else []), *STEP_COLS[5:]]
    return fit("steps", cols, rows, width)


RANK_COLS = [
    Col("rank", left=True),
    Col("micro-batches", "micro-\nbatches", keep=1),
    Col("samples", keep=3),
    Col("row tokens", "row\ntokens", keep=2),
    Col("real tokens", "real\ntokens"),
    Col("cost share", "cost\nshare"),
    Col("tokens per micro-batch", "tokens per\nmicro-batch", wrap=True),
]


def _rank_table(s: dict[str, Any], width: int | None) -> Table:
    total = sum(r["cost"] for r in s["ranks"]) or 1.0
    rows = [
        [
            str(r["rank"]),
            count(r["micro_batches"]),
            count(r["samples"]),
            count(r["row_tokens"]),
            count(r["real_tokens"]),
            pct(r["cost"] / total),
            " ".join(f"{x:,}" for x in r["micro_batch_tokens"]),
        ]
        for r in s["ranks"]
    ]
    t = fit(f"step {s['step']}: ranks", RANK_COLS, rows, width)
    return t


def render_packed(
    report: dict[str, Any],
    *,
    per_step: bool = False,
    step: int | None = None,
    width: int | None = None,
) -> list[RenderableType]:
    chosen = report["config"].get("balance") or "chosen"
    world = report.get("world") or {}
    split = _split(world) is not None and bool(world.get("gpu_budget"))
    bal = dict(report["totals"]["balance"])
    rows: dict[str, Any] = {f"{chosen} (chosen)": bal.pop("chosen"), **bal}
    title = "balance: the chosen split vs a token or count split (mean over steps)"
    out: list[RenderableType] = [
        _header(report),
        _run_table(report, width),
        _env_table("envs (all steps)", report["totals"]["envs"], width, split),
        _balance_table(title, chosen, rows, width),
        _fill_table(report["totals"]["fill_histogram"]),
    ]
    if "hybrid" in report["totals"]:
        out.append(_hybrid_table(report["totals"]["hybrid"], width))
    if "shared" in report["totals"]:
        out.append(_shared_table(report["totals"]["shared"], width))
        if per_step:
            out.append(_shared_steps_table(report["steps"], width))
    structured = bool(structure(report["config"]["epochs"], report["config"]["mini_batches"]))
    if per_step:
        out.append(_steps_table(report["steps"], width, split, structured))
    if step is not None:
        s = next(x for x in report["steps"] if x["step"] == step)
        if not per_step:
            out.append(_steps_table([s], width, split, structured))
        out.append(_env_table(f"step {s['step']}: envs", s["envs"], width, split))
        alt = s.get("alternatives") or {}
        me = {k: s[k] for k in ("micro_batches_per_rank", "rank_imbalance", "lockstep_overhead")}
        out.append(_balance_table(f"step {s['step']}: balance", chosen, {f"{chosen} (chosen)": me, **alt}, width))  # fmt: skip
        out.append(_rank_table(s, width))
    return out


def render(
    report: dict[str, Any],
    *,
    per_step: bool = False,
    step: int | None = None,
    width: int | None = None,
) -> RenderableType:
    """All tables of a report (rollout Parquet or packed run) as one renderable, each fitted to
    ``width`` columns (the terminal's; None: every column at its full header)."""
    if report["kind"] == "packed":
        parts = render_packed(report, per_step=per_step, step=step, width=width)
    else:
        parts = render_rollouts(report, width)
    spaced: list[RenderableType] = []
    for p in parts:
        spaced.extend([p, Text("")])
    return Group(*spaced[:-1])


# --- the pack and advantages reports: the same figures, formatted the same way -----------------

MAX_ENV_STEPS = 20
"""Beyond this many steps, pack's per-env table shows run totals (the stats table of them)."""

PACK_STEP_COLS = [
    Col("step"),
    Col("size (status)"),  # named for the batch unit in _pack_steps_table
    Col("groups", keep=3),
    Col("rollouts", keep=1),
    Col("samples", keep=6),
    Col("sampled tokens", "sampled\ntokens"),
    Col("trainable tokens", "trainable\ntokens", keep=5),
    Col("uniform kept / dropped", "uniform\nkept/drop", keep=4),
    Col("over-long", "over-\nlong", keep=2),
    Col("mb / rank", "mb /\nrank", keep=7),
    Col("token fill", "token\nfill", keep=8),
    Col("rank imb. (cost)", "rank imb.\n(cost)"),
    Col("lockstep ovh. (cost)", "lockstep\n(cost)"),
]

PACK_ENV_COLS = [
    Col("step"),
    Col("env", left=True),
    Col("groups", keep=3),
    Col("rollouts", keep=1),
    Col("samples", keep=6),
    Col("sampled tokens", "sampled\ntokens"),
    Col("trainable tokens", "trainable\ntokens", keep=5),
    Col("uniform kept / dropped", "uniform\nkept/drop", keep=4),
    Col("over-long", "over-\nlong", keep=2),
    Col("reward mean", "reward\nmean"),
    Col("adv mean", "adv\nmean"),
    Col("adv std", "adv\nstd", keep=7),
    Col("loss weight", "loss\nweight"),
]


def _counts(c: StepCounts, split: bool = False) -> list[str]:
    """The columns a step and an env of it share (groups .. over-long, and with ``split``
    over the GPU budget)."""
    return [
        count(c.groups),
        count(c.rollouts),
        count(c.samples),
        count(c.sampled_tokens),
        count(c.trainable_tokens),
        f"{count(c.uniform_groups_kept)} / {count(c.uniform_groups_dropped)}",
        count(c.overlong_dropped),
        *([count(c.over_gpu_budget)] if split else []),
    ]


def _with_split(cols: Sequence[Col], split: bool) -> list[Col]:
    """``cols`` with `OVER_GPU_COL` after "over-long" when ``split``."""
    at = [c.header for c in cols].index("over-long") + 1
    return [*cols[:at], *([OVER_GPU_COL] if split else []), *cols[at:]]


def _pack_world(manifest: Manifest) -> dict[str, Any] | None:
    """The world of an sp/cp pack (`world_layout`), None without sp/cp."""
    world = world_layout(manifest)
    return world if _split(world) is not None else None


MAX_STEP_ROWS = 12
"""Beyond this many steps, pack's step table shows the first and last few and a total row
(``--per-step`` for every step)."""

EDGE_STEPS = 3
"""Steps shown at each end of a summarised step table."""


def _pack_step_row(st: StepRecord, split: bool = False, structured: bool = False) -> list[str]:
    size = f"{count(st.actual)}/{count(st.nominal)}"
    p = st.plan
    return [step_label(st.step, st.batch, st.epoch, st.mini_batch, structured),
            size if st.status == "full" else f"{size} {st.status}", *_counts(st, split),
            str(p.micro_batches_per_rank), pct(p.token_fill), over(p.imbalance_cost),
            over(p.lockstep_overhead_cost)]  # fmt: skip


def _pack_total_row(steps: Sequence[StepRecord], split: bool = False) -> list[str]:
    """The run's totals in the step table's columns: sums, and the mean of the per-step ratios
    (token fill, imbalance, overhead)."""

    def mean(values: list[float | None]) -> float | None:
        xs = [x for x in values if x is not None]
        return sum(xs) / len(xs) if xs else None

    t = {k: sum(getattr(s, k) for s in steps) for k in COUNTS}
    nominal = sum(s.nominal or 0 for s in steps)
    size = f"{count(sum(s.actual for s in steps))}/{count(nominal)}"
    plans = [s.plan for s in steps]
    return ["all", size,
            *(count(t[k]) for k in COUNTS[:5]),
            f"{count(t['uniform_groups_kept'])} / {count(t['uniform_groups_dropped'])}",
            count(t["overlong_dropped"]), *([count(t["over_gpu_budget"])] if split else []),
            count(sum(p.micro_batches_per_rank for p in plans)),
            pct(mean([p.token_fill for p in plans])),
            over(mean([p.imbalance_cost for p in plans])),
            over(mean([p.lockstep_overhead_cost for p in plans]))]  # fmt: skip


def _pack_steps_table(
    manifest: Manifest, output: str, width: int | None, per_step: bool = False
) -> Table:
    """One row per step: size in batch units (and why it is not full), counts, layout, balance.
    More than `MAX_STEP_ROWS` steps (and not ``per_step``): the first and last `EDGE_STEPS`,
    then a total row (ratios: mean over steps)."""
    unit, align = manifest.config.steps.batch_unit, manifest.config.align
    steps = manifest.steps
    split = _splits_budget(manifest)
    structured = bool(structure(*(recorded_structure(manifest.config) or (1, 1))))
    title = f"pack -> {output} ({manifest.workload.kind} balance, {align})"
    cols = _with_split(
        [PACK_STEP_COLS[0], Col(f"{unit} (status)", f"{unit}\n(status)"), *PACK_STEP_COLS[2:]],
        split,
    )
    rows: list[Sequence[str] | None]
    if per_step or len(steps) <= MAX_STEP_ROWS:
        rows = [_pack_step_row(st, split, structured) for st in steps]
    else:
        skipped = len(steps) - 2 * EDGE_STEPS
        rows = [*(_pack_step_row(st, split, structured) for st in steps[:EDGE_STEPS]),
                ["…", f"{skipped:,} steps", *[""] * (len(cols) - 2)],
                *(_pack_step_row(st, split, structured) for st in steps[-EDGE_STEPS:])]  # fmt: skip
        title += f", {len(steps):,} steps (--per-step: all)"
    short = sum(st.status != "full" for st in steps)
    if short and len(steps) > 1:
        title += f", {short:,} not full"
    if len(steps) > 1:
        rows += [None, _pack_total_row(steps, split)]
    return fit(title, cols, rows, width)


def _splits_budget(manifest: Manifest) -> bool:
    """An sp/cp pack with a per-GPU token budget: its tables count the samples over it."""
    world = _pack_world(manifest)
    return world is not None and bool(world["gpu_budget"])


def _pack_envs_table(manifest: Manifest, width: int | None, per_step: bool = False) -> Table:
    """Per step and env what each env contributes; for long runs (unless ``per_step``), the
    per-env run totals."""
    steps = manifest.steps
    split = _splits_budget(manifest)
    if len(steps) > MAX_ENV_STEPS and not per_step:
        title = f"per env, all {len(steps)} steps (--per-step for each)"
        return _env_table(title, env_totals(steps), width, split)
    rows: list[Sequence[str] | None] = [
        [str(st.step), env, *_counts(e, split), num(e.reward_mean, ".3f"), num(e.advantage_mean, "+.3f"),
         num(e.advantage_std, ".3f"), num(e.loss_weight_sum, ".3f")]
        for st in steps
        for env, e in st.envs.items()
    ]  # fmt: skip
    return fit("per step and env", _with_split(PACK_ENV_COLS, split), rows, width)


def render_pack(
    manifest: Manifest, output: str, *, width: int | None = None, per_step: bool = False
) -> RenderableType:
    """What ``rolltool pack`` prints on stdout: its steps (summarised beyond `MAX_STEP_ROWS`
    unless ``per_step``), and its envs per step (or in total beyond `MAX_ENV_STEPS`); with sp
    or cp, first the world (`world_line`)."""
    world = _pack_world(manifest)
    return Group(
        *([Text(f"world: {world_line(world)}")] if world else []),
        _pack_steps_table(manifest, output, width, per_step),
        Text(""),
        _pack_envs_table(manifest, width, per_step),
    )


def pack_summary(manifest: Manifest, output: str) -> str:
    """The one line ``rolltool pack`` ends with (on stderr): where every sample went."""
    s = manifest.samples
    world = _pack_world(manifest)
    gpus = trained = ""
    if world is not None:
        kind, k = _split(world) or ("", 1)
        gpus = f" (x {kind} {k} = {world['gpus']:,} GPUs)"
        if world["gpu_budget"]:
            over = sum(st.over_gpu_budget for st in manifest.steps)
            trained = f" ({over:,} over the per-GPU budget, split over {kind})"
    epochs, mini_batches = recorded_structure(manifest.config) or (1, 1)
    what = "samples" if epochs == 1 else f"(sample, epoch) pairs ({epochs} epochs)"
    return (
        f"wrote {manifest.num_steps} steps{structure(epochs, mini_batches)} x {manifest.dp} ranks{gpus} to "
        f"{output}: {s.trained:,} of {s.total:,} {what} trained{trained}, {s.uniform_dropped:,} in "
        f"dropped uniform groups, {s.overlong_dropped:,} over-long, {s.leftover:,} left over"
        + (f", {s.count_trimmed:,} trimmed for --equal-count" if s.count_trimmed else "")
        + _reads_note(manifest)
    )


def _reads_note(manifest: Manifest) -> str:
    """How the steps' tokens were read, when that was more than reading the input once: the
    plan's read amplification and the path taken (`rolltool.fetch.readplan`, `rolltool.fetch.buckets`)."""
    r = manifest.reads
    if r is None:
        return ""
    if r.path == "exchange":
        why = (f"fetching step by step would have read it {r.cached_amplification:.1f}x over"
               if r.cached_amplification >= 2 else "as asked")  # fmt: skip
        return f"; the input was read once into step buckets (the exchange path: {why})"
    if r.cached_amplification >= 2:
        return f"; fetching the steps read the input {r.cached_amplification:.1f}x over"
    return ""


ADVANTAGE_COLS = [
    Col("env", left=True),
    Col("estimator", left=True),
    Col("groups", keep=2),
    Col("rollouts", keep=1),
    Col("samples", keep=3),
    Col("uniform"),
    Col("reward mean±std", "reward\nmean±std"),
    Col("adv mean±std", "adv\nmean±std"),
    Col("adv min", "adv\nmin", keep=4),
    Col("adv max", "adv\nmax", keep=4),
]


def render_advantages(report: dict[str, Any], *, width: int | None = None) -> Table:
    """``rolltool advantages``' table: per env (and all envs), the estimator's figures."""
    rows: list[Sequence[str] | None] = []
    for r in report["envs"] + ([report["overall"]] if len(report["envs"]) > 1 else []):
        rows.append(
            [ALL if r["env"] is None else r["env"], r["estimator"] or "", count(r["groups"]),
             count(r["rollouts"]), count(r["samples"]),
             f"{count(r['uniform_groups'])} ({pct(r['uniform_share'], '.0%')})",
             f"{num(r['reward_mean'], '.3f')}±{num(r['reward_std'], '.3f')}",
             f"{num(r['advantage_mean'], '.3f')}±{num(r['advantage_std'], '.3f')}",
             num(r["advantage_min"], ".3f"), num(r["advantage_max"], ".3f")]
        )  # fmt: skip
    return fit(f"advantages -> {report['output']}", ADVANTAGE_COLS, rows, width)
