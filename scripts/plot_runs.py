"""Training curves of one or more runs as PNG files, and a before -> after eval table.

    .venv/bin/python scripts/plot_runs.py runs/search_grpo runs/search_ppo --out plots/
    .venv/bin/python scripts/plot_runs.py runs/a runs/b --out plots/ --metrics reward,kl --smooth 5
    .venv/bin/python scripts/plot_runs.py runs/a runs/b --table            # markdown, for docs/results.md

A run directory is a trainer workdir (it holds `tensorboard/`) or its `tensorboard/` directory itself. The
scalars come from `tensorboard/metrics.jsonl` (the trainer's MetricWriter writes every scalar there too; a
resumed run's rewritten steps keep their last value); a run without that file is read from its TensorBoard
event files.

One PNG per metric group (`GROUPS`: reward, success, eval_success, kl, entropy, response_length, tool_calls,
tool_errors), every run overlaid in its own colour; `--metrics` picks groups, or raw tags (e.g.
`time/update_s`) which get a plot each. A metric a run did not log is reported by name and left out; a group
no run logged writes no PNG. `--smooth N` draws a trailing N-point mean over the raw curve (eval points are
never smoothed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

Series = list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class Curve:
    """One line of a plot: a logged tag, or a value derived from several tags at the same steps."""

    label: str
    tags: tuple[str, ...]
    combine: Callable[..., float] | None = None  # None: the single tag's value

    def series(self, scalars: Mapping[str, Series]) -> Series | None:
        if any(tag not in scalars for tag in self.tags):
            return None
        if self.combine is None:
            return list(scalars[self.tags[0]])
        columns = [dict(scalars[tag]) for tag in self.tags]
        steps = sorted(set.intersection(*(set(c) for c in columns)))
        return [(step, self.combine(*(c[step] for c in columns))) for step in steps]


def _per(count: float, total: float) -> float:
    return count / total if total else math.nan


@dataclasses.dataclass(frozen=True)
class Group:
    title: str
    ylabel: str
    curves: tuple[Curve, ...]
    points: bool = False  # eval: a few points (markers), never smoothed


GROUPS: dict[str, Group] = {
    "reward": Group("train reward (mean per chain)", "reward", (Curve("reward/mean", ("reward/mean",)),)),
    "success": Group("train success rate", "success", (Curve("success/rate", ("success/rate",)),)),
    "eval_success": Group(
        "held-out eval success (before → after)",
        "success",
        (
            Curve("eval/success", ("eval/success",)),
            Curve("eval/success_sampled", ("eval/success_sampled",)),
        ),
        points=True,
    ),
    "kl": Group(
        "KL",
        "KL",
        (
            Curve("policy/approx_kl (to the rollout policy)", ("policy/approx_kl",)),
            Curve("policy/kl_ref (to the reference)", ("policy/kl_ref",)),
        ),
    ),
    "entropy": Group("policy entropy (per action token)", "nats", (Curve("policy/entropy", ("policy/entropy",)),)),
    "response_length": Group(
        "response length (action tokens per chain)",
        "tokens",
        (Curve("rollout/response_tokens_mean", ("rollout/response_tokens_mean",)),),
    ),
    "tool_calls": Group(
        "tool calls per chain", "calls", (Curve("rollout/tool_calls_mean", ("rollout/tool_calls_mean",)),)
    ),
    "tool_errors": Group(
        "tool errors per chain",
        "errors",
        (Curve("rollout/tool_errors / rollout/chains", ("rollout/tool_errors", "rollout/chains"), _per),),
    ),
}


@dataclasses.dataclass
class RunData:
    name: str
    directory: Path
    scalars: dict[str, Series]
    source: str  # "jsonl" or "tensorboard"
    summary: dict | None = None
    config: dict | None = None  # the run's config.json (written at its start: there for a run cut short too)


def _float(value) -> float:
    return float(value)  # "nan" / "inf" strings (the writer keeps non-finite values as text) parse too


def read_jsonl(path: Path) -> dict[str, Series]:
    """{tag: [(step, value)]} from a MetricWriter JSONL; a step logged twice (a resumed run) keeps its last
    value; lines that do not parse (a run killed mid-write) are skipped."""
    by_tag: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            step = int(record.pop("step"))
        except (ValueError, KeyError, TypeError):
            continue
        for tag, value in record.items():
            try:
                by_tag.setdefault(tag, {})[step] = _float(value)
            except (TypeError, ValueError):
                continue
    return {tag: sorted(values.items()) for tag, values in by_tag.items()}


def read_event_files(directory: Path) -> dict[str, Series]:
    """{tag: [(step, value)]} from the TensorBoard event files in `directory` (last value per step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    out = {}
    for tag in accumulator.Tags().get("scalars", []):
        values = {event.step: float(event.value) for event in accumulator.Scalars(tag)}
        out[tag] = sorted(values.items())
    return out


def load_run(directory: str | os.PathLike, name: str | None = None) -> RunData:
    """A run's scalars (JSONL preferred, else the event files) and its summary.json, if any."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory (no metrics.jsonl or TensorBoard files there)")
    logdir = directory / "tensorboard" if (directory / "tensorboard").is_dir() else directory
    workdir = directory if logdir != directory else directory.parent
    jsonl = logdir / "metrics.jsonl"
    scalars, source = {}, "jsonl"
    if jsonl.is_file():
        scalars = read_jsonl(jsonl)
    if not scalars:
        scalars, source = read_event_files(logdir), "tensorboard"
    if not scalars:
        raise FileNotFoundError(f"{directory}: no metrics.jsonl and no TensorBoard scalars found")
    summary_path = workdir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    config_path = workdir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else None
    return RunData(name or directory.resolve().name, directory, scalars, source, summary, config)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` finite values (NaNs are skipped, not spread)."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def _group_for(key: str) -> Group:
    if key in GROUPS:
        return GROUPS[key]
    return Group(key, key, (Curve(key, (key,)),))


def plot_group(
    key: str, runs: Sequence[RunData], out: Path, smooth_window: int = 1, report: Callable[[str], None] = print
) -> Path | None:
    """Writes `<out>/<key>.png` with every run's curves of the group; None (and a report) when no run has any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = _group_for(key)
    drawn = []
    figure, axes = plt.subplots(figsize=(8, 4.8), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for r, run in enumerate(runs):
        colour = colours[r % len(colours)]
        for c, curve in enumerate(group.curves):
            series = curve.series(run.scalars)
            if not series:
                report(f"{run.name}: no {' / '.join(curve.tags)} ({key}); skipped")
                continue
            steps = [s for s, _ in series]
            values = [v for _, v in series]
            label = run.name if len(group.curves) == 1 else f"{run.name}: {curve.label}"
            if group.points:
                axes.plot(steps, values, marker="o", linestyle=styles[c % 4], color=colour, label=label)
                for step, value in (series[0], series[-1]) if len(runs) <= 2 else ():  # few runs: label the ends
                    axes.annotate(f"{value:.3f}", (step, value), textcoords="offset points", xytext=(4, 6),
                                  fontsize=8, color=colour)
            elif smooth_window > 1:
                axes.plot(steps, values, linestyle=styles[c % 4], color=colour, alpha=0.3, linewidth=1)
                axes.plot(steps, smooth(values, smooth_window), linestyle=styles[c % 4], color=colour,
                          linewidth=2, label=f"{label} ({smooth_window}-pt mean)")
            else:
                axes.plot(steps, values, linestyle=styles[c % 4], color=colour, linewidth=1.8, label=label,
                          marker="." if len(series) < 30 else None)
            drawn.append(label)
    if not drawn:
        plt.close(figure)
        report(f"{key}: no run logged it; no plot written")
        return None
    names = ", ".join(run.name for run in runs)
    axes.set_title(f"{group.title}\n{names}", fontsize=10)
    axes.set_xlabel("step")
    axes.set_ylabel(group.ylabel)
    axes.grid(alpha=0.3)
    axes.margins(x=0.04, y=0.12)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{key.replace('/', '_')}.png"
    figure.savefig(path)
    plt.close(figure)
    return path


def before_after(run: RunData, tag: str) -> tuple[float, float] | None:
    """(first, last) logged value of an eval tag: the eval before training (step 0) and the final one."""
    series = run.scalars.get(tag)
    if not series:
        return None
    return series[0][1], series[-1][1]


def _cell(pair: tuple[float, float] | None) -> str:
    if pair is None:
        return "—"
    before, after = pair
    return f"{before:.3f} → {after:.3f} ({after - before:+.3f})"


def table(runs: Sequence[RunData]) -> str:
    """Markdown: per run, held-out eval success and reward before -> after training (and the step counts)."""
    lines = [
        "| run | algorithm | environment | steps | eval success before → after | eval reward before → after |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        summary, config = run.summary or {}, run.config or {}
        evals = run.scalars.get("eval/success") or run.scalars.get("eval/reward") or []
        algorithm = summary.get("algorithm") or config.get("algorithm") or "—"
        environment = (summary.get("environment") or (config.get("env") or {}).get("name")
                       or (config.get("task") or {}).get("train_path") or "—")
        if "steps" in summary:
            steps = summary["steps"]
        else:  # no summary: the run stopped before its end; say how far its last eval got
            planned = (config.get("rl") or {}).get("steps")
            steps = f"{evals[-1][0] if evals else 0} of {planned}, cut" if planned else (evals[-1][0] if evals else "—")
        lines.append(
            f"| {run.name} | {algorithm} | {environment} | {steps} | "
            f"{_cell(before_after(run, 'eval/success'))} | {_cell(before_after(run, 'eval/reward'))} |"
        )
    return "\n".join(lines)


def plot_runs(
    directories: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    metrics: Sequence[str] = tuple(GROUPS),
    smooth_window: int = 1,
    names: Sequence[str] | None = None,
    report: Callable[[str], None] = print,
) -> dict[str, Path]:
    """{group: PNG path} for the groups some run logged (see the module docstring)."""
    runs = [load_run(d, n) for d, n in zip(directories, names or [None] * len(directories))]
    written = {}
    for key in metrics:
        path = plot_group(key, runs, Path(out), smooth_window, report)
        if path is not None:
            written[key] = path
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories (trainer workdirs or their tensorboard/)")
    parser.add_argument("--out", default=None, help="directory for the PNG files")
    parser.add_argument("--metrics", action="append", default=None,
                        help=f"groups or raw tags, comma-separated or repeated (default: {','.join(GROUPS)})")
    parser.add_argument("--smooth", type=int, default=1, help="trailing mean over N points (1: none)")
    parser.add_argument("--names", default=None, help="comma-separated legend names, one per run")
    parser.add_argument("--table", action="store_true", help="print a markdown before -> after eval table")
    args = parser.parse_args(argv)
    if args.out is None and not args.table:
        parser.error("nothing to do: give --out DIR (plots) and/or --table")
    if args.smooth < 1:
        parser.error("--smooth must be at least 1")
    names = args.names.split(",") if args.names else None
    if names is not None and len(names) != len(args.runs):
        parser.error(f"--names has {len(names)} names for {len(args.runs)} runs")
    metrics = [m.strip() for value in (args.metrics or [",".join(GROUPS)]) for m in value.split(",") if m.strip()]
    if args.out is not None:
        written = plot_runs(args.runs, args.out, metrics, args.smooth, names,
                            report=lambda message: print(message, file=sys.stderr))
        for key, path in written.items():
            print(f"{key}: {path}")
    if args.table:
        runs = [load_run(d, n) for d, n in zip(args.runs, names or [None] * len(args.runs))]
        print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
