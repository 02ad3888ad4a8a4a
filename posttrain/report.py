"""The run report: PNG plots and one self-contained HTML page from a run folder's metrics.

What it is: `write_report(run_dir, stages=None, samples=None)` reads `<run_dir>/config.yaml`
and `<run_dir>/metrics.jsonl` (one JSON object a line, each with "step"; evaluation records
may be separate lines holding only `eval_*` keys) and writes into `<run_dir>/report/`:
  - one PNG per series that the run logged, over steps: loss, reward (`reward/mean`), KL (`kl`,
    `teacher_kl`), accuracy (every key naming an accuracy, accuracies or agreement), learning
    rate (`lr`) and throughput (`tokens_per_s`). A series' `eval_` twin is drawn on the same
    axes (same colour, dashed, with markers). A series the run never logged gets no PNG (and a
    stale PNG of it from an earlier report is removed), so there is never an empty plot.
  - `report.html`: the PNGs inlined as base64 `data:` URIs, so the page opens offline, from a
    copied file or a CI artifact (no external URL anywhere); an optional stage table (`stages`,
    a list of dicts, one row each: the columns are the union of their keys, None shown as "—"),
    optional sample completions (`samples`, {"prompt", "completion"} dicts) and the config YAML.
    All text from the run (config, stage values, prompts, completions) is HTML-escaped.
Every file is written atomically (a temporary file, then `os.replace`), so a reader never sees
half a page. Plots use matplotlib's Agg canvas directly (no pyplot: no global backend change,
no display needed).

What it is not: a metrics sink (`train.metrics` writes metrics.jsonl), a live dashboard
(TensorBoard is a sink for that) or an evaluator: stage results and sample completions come
from the caller. Call it from process 0 only.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from typing import Callable, Sequence

from posttrain.errors import PosttrainError

REPORT_DIR = "report"

# (file stem, title, y label, does a train-side metric key belong to this plot?)
PLOTS: tuple[tuple[str, str, str, Callable[[str], bool]], ...] = (
    ("loss", "Loss", "loss", lambda k: k == "loss"),
    ("reward", "Reward", "mean reward", lambda k: k == "reward/mean"),
    ("kl", "KL divergence", "KL", lambda k: k in ("kl", "teacher_kl")),
    ("accuracy", "Accuracy", "fraction",
     lambda k: any(w in k for w in ("accuracy", "accuracies", "agreement"))),
    ("sampled", "Sampled answers (pass@k, maj@k)", "fraction", lambda k: k.startswith(("pass@", "maj@"))),
    ("lr", "Learning rate", "lr", lambda k: k == "lr"),
    ("tokens_per_s", "Throughput", "tokens / s", lambda k: k == "tokens_per_s"),
)


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl file, in file order. Blank lines are skipped; a line that is
    not a JSON object with a numeric "step" raises PosttrainError naming FILE:LINE."""
    if not os.path.isfile(path):
        raise PosttrainError(f"{path}: no such metrics file; pass a run folder written by a posttrain "
                             "trainer (it holds config.yaml and metrics.jsonl)")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PosttrainError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or delete the line") from None
            if not isinstance(rec, dict) or not _is_number(rec.get("step")):
                raise PosttrainError(f'{path}:{lineno}: expected a JSON object with a numeric "step", '
                                     f"got {line.strip()[:80]!r}; fix or delete the line")
            records.append(rec)
    return records


def collect_series(records: Sequence[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """{metric key: (steps, values)} over the records, steps ascending. Non-numeric and
    non-finite values are left out; when a step repeats (a resumed run), the later value wins."""
    by_key: dict[str, dict[float, float]] = {}
    for rec in records:
        step = rec["step"]
        for k, v in rec.items():
            if k != "step" and _is_number(v) and math.isfinite(v):
                by_key.setdefault(k, {})[step] = float(v)
    return {k: (sorted(pts), [pts[s] for s in sorted(pts)]) for k, pts in by_key.items() if pts}


def write_report(run_dir: str, *, stages: Sequence[dict] | None = None,
                 samples: Sequence[dict] | None = None) -> str:
    """Write `<run_dir>/report/` (one PNG per logged series + report.html); returns the page's path."""
    series = collect_series(read_metrics(os.path.join(run_dir, "metrics.jsonl")))
    out = os.path.join(run_dir, REPORT_DIR)
    os.makedirs(out, exist_ok=True)
    plots = []  # (title, png bytes)
    for stem, title, ylabel, match in PLOTS:
        png_path = os.path.join(out, f"{stem}.png")
        train = sorted(k for k in series if not k.startswith("eval_") and match(k))
        evals = sorted(k for k in series if k.startswith("eval_") and match(k[len("eval_"):]))
        if not train and not evals:
            if os.path.exists(png_path):
                os.remove(png_path)  # a stale plot from an earlier report of this folder
            continue
        png = _plot(series, train, evals, title, ylabel)
        _atomic_write(png_path, png)
        plots.append((title, png))
    config_path = os.path.join(run_dir, "config.yaml")
    config = open(config_path, encoding="utf-8").read() if os.path.isfile(config_path) else None
    page = _html(run_dir, config, series, plots, stages, samples)
    path = os.path.join(out, "report.html")
    _atomic_write(path, page.encode("utf-8"))
    return path


def _eval_plots(series) -> list[tuple[str, bytes]]:
    """(title, PNG) of each plot that a run's eval_ series belong to (PLOTS), then one of the rest."""
    evals = [k for k in series if k.startswith("eval_") and k != "eval_seconds"]
    out, used = [], set()
    for _, title, ylabel, match in PLOTS:
        keys = sorted(k for k in evals if match(k[len("eval_"):]))
        if keys:
            out.append((title, _plot(series, [], keys, title, ylabel)))
            used.update(keys)
    for k in sorted(set(evals) - used):
        out.append((k, _plot(series, [], [k], k, k)))
    return out


def write_pipeline_report(out_dir: str, stage_runs: Sequence[tuple[str, str]], *,
                          stages: Sequence[dict] | None = None, samples: Sequence[dict] | None = None) -> str:
    """One page for a chain of runs (a pipeline, the demo): the stage table, then every stage's evaluation
    curves (its `eval_*` metrics against its steps; a stage without evaluations shows its loss), the
    sample completions; `<out_dir>/report/report.html`, returned."""
    parts, esc = [], html.escape
    for name, run_dir in stage_runs:
        path = os.path.join(run_dir, "metrics.jsonl")
        series = collect_series(read_metrics(path)) if os.path.isfile(path) else {}
        plots = _eval_plots(series) or ([("loss", _plot(series, ["loss"], [], "Loss", "loss"))]
                                        if "loss" in series else [])
        parts.append(f'<h2>Stage {esc(name)}</h2><p class="muted">{esc(os.path.abspath(run_dir))}</p>')
        parts.append('<div class="plots">' + "".join(
            f'<img alt="{esc(name)}: {esc(t)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
            for t, png in plots) + "</div>" if plots else '<p class="muted">no metrics logged</p>')
    page = _html(out_dir, None, {}, [], stages, samples, body="\n".join(parts), title="pipeline report")
    out = os.path.join(out_dir, REPORT_DIR)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "report.html")
    _atomic_write(path, page.encode("utf-8"))
    return path


def compare_runs(run_dirs: Sequence[str], png_path: str) -> tuple[str, str]:
    """(table, png path): the evaluation metrics (`eval_*`) of several runs, the table with each metric's
    last and best value (and step) per run, the PNG one panel per metric with one line per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [(os.path.basename(os.path.abspath(d)) or d,
             collect_series(read_metrics(os.path.join(d, "metrics.jsonl")))) for d in run_dirs]
    keys = sorted({k for _, series in runs for k in series if k.startswith("eval_") and k != "eval_seconds"})
    if not keys:
        raise PosttrainError(f"none of {', '.join(run_dirs)} logged evaluation metrics (eval_*); train with "
                             "train.eval_every and data.eval (and eval.k for sampled answers)")
    width, mw = max(3, *(len(n) for n, _ in runs)), max(6, *map(len, keys))
    lines = [f"{'run':<{width}} | {'metric':<{mw}} | {'last':>9} | {'best':>9} | best step", "-" * (width + mw + 40)]
    for name, series in runs:
        for k in keys:
            if k not in series:
                continue
            steps, values = series[k]
            lower = k.endswith(("loss", "length", "kl"))  # smaller is better for these
            i = min(range(len(values)), key=lambda j: values[j] if lower else -values[j])
            lines.append(f"{name:<{width}} | {k:<{mw}} | {values[-1]:>9.4f} | {values[i]:>9.4f} | {_fmt(steps[i])}")
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig = Figure(figsize=(4.6 * cols, 3.3 * rows), dpi=100)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.92, bottom=0.1, hspace=0.45, wspace=0.3)
    FigureCanvasAgg(fig)
    for i, k in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        for j, (name, series) in enumerate(runs):
            if k in series:
                ax.plot(*series[k], color=f"C{j % 10}", marker="o", markersize=3, label=name)
        ax.set_title(k, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    _atomic_write(png_path, buf.getvalue())
    return "\n".join(lines), png_path


def _plot(series, train: list[str], evals: list[str], title: str, ylabel: str) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # fixed margins: matplotlib's constrained layout costs ~0.2 s a plot, and every finished run draws four
    fig = Figure(figsize=(6.0, 3.6), dpi=100)
    fig.subplots_adjust(left=0.12, right=0.97, top=0.91, bottom=0.14)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # A train key and its eval_ twin share a colour; colours follow the default cycle (C0 first).
    bases = list(dict.fromkeys(train + [k[len("eval_"):] for k in evals]))
    colour = {b: f"C{i % 10}" for i, b in enumerate(bases)}
    for k in train:
        steps, values = series[k]
        ax.plot(steps, values, color=colour[k], linewidth=1.8, label=k)
    for k in evals:
        steps, values = series[k]
        ax.plot(steps, values, color=colour[k[len("eval_"):]], linestyle="--", marker="o",
                markersize=4, linewidth=1.5, label=k)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
.plots img { width: 100%; border: 1px solid #ddd; }
pre { background: #f7f7f7; padding: 8px; white-space: pre-wrap; word-break: break-word; }
#samples td { vertical-align: top; } #samples pre { margin: 0; } .muted { color: #777; }
"""


def _html(run_dir, config, series, plots, stages, samples, body: str | None = None,
          title: str = "run report") -> str:
    esc = html.escape
    name = os.path.basename(os.path.abspath(run_dir))
    steps = series.get("loss", next(iter(series.values()), ([], [])))[0]
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>posttrain report: {esc(name)}</title><style>{_CSS}</style></head><body>",
             f"<h1>posttrain {esc(title)}: {esc(name)}</h1>",
             f'<p class="muted">{esc(os.path.abspath(run_dir))}'
             + (f" · steps {_fmt(steps[0])}–{_fmt(steps[-1])}" if steps else "") + "</p>"]
    if stages:
        columns = list(dict.fromkeys(k for row in stages for k in row))
        parts.append('<h2>Stages</h2><table id="stages"><tr>'
                     + "".join(f"<th>{esc(str(c))}</th>" for c in columns) + "</tr>")
        for row in stages:
            cells = [(row.get(c), _is_number(row.get(c))) for c in columns]
            parts.append("<tr>" + "".join(f'<td{" class=num" if num else ""}>{esc(_fmt(v))}</td>'
                                          for v, num in cells) + "</tr>")
        parts.append("</table>")
    if body is not None:  # a pipeline page: its own sections instead of one run's curves
        parts.append(body)
    elif plots:
        parts.append("<h2>Training curves</h2><div class=\"plots\">")
        for title, png in plots:
            data = base64.b64encode(png).decode("ascii")
            parts.append(f'<img alt="{esc(title)}" src="data:image/png;base64,{data}">')
        parts.append("</div>")
    else:
        parts.append('<h2>Training curves</h2><p class="muted">metrics.jsonl holds none of the plotted series yet.</p>')
    if samples:
        parts.append('<h2>Sample completions</h2><table id="samples"><tr><th>prompt</th><th>completion</th></tr>')
        for s in samples:
            parts.append(f'<tr><td><pre>{esc(str(s.get("prompt", "")))}</pre></td>'
                         f'<td><pre>{esc(str(s.get("completion", "")))}</pre></td></tr>')
        parts.append("</table>")
    if body is None:
        parts.append("<h2>Config</h2>")
        parts.append(f'<pre id="config">{esc(config)}</pre>' if config is not None
                     else '<p class="muted">no config.yaml in the run folder</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
