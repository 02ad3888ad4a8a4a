"""The run report (posttrain/report.py): PNGs for the series a run logged and none for the others,
a self-contained HTML page with escaped text, FILE:LINE errors for bad metrics, and a headless
Chromium screenshot showing that the plots are drawn."""

import base64
import json
import math
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from posttrain.errors import PosttrainError
from posttrain.report import collect_series, read_metrics, write_report

CONFIG = 'model:\n  preset: demo-tiny\nnote: "<b>bold</b> & co"\ntrain:\n  steps: 40\n'
STAGES = [{"stage": "sft", "accuracy": 0.41, "kl": None, "seconds": 80.2},
          {"stage": "dpo", "accuracy": 0.5678912, "kl": 0.0123, "seconds": 95}]
SAMPLES = [{"prompt": "12+30=<", "completion": "42 & done</s>"}]


def make_run(tmp_path, steps=40):
    """A run folder by hand: train records (loss, lr, tokens_per_s, rewards/accuracies) every 2
    steps and separate eval records (eval_loss, eval_top1_agreement) every 10; no reward, no KL."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(CONFIG)
    lines = []
    for s in range(2, steps + 1, 2):
        lines.append({"step": s, "loss": 5.0 * math.exp(-s / 15), "lr": 1e-3 * min(1.0, s / 10),
                      "tokens_per_s": 200.0 + s, "rewards/accuracies": min(1.0, s / steps), "denom": 8.0})
        if s % 10 == 0:
            lines.append({"step": s, "eval_loss": 5.5 * math.exp(-s / 18), "eval_top1_agreement": s / 50})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def test_report_plots_present_series_only(tmp_path):
    run = make_run(tmp_path)
    (run / "report").mkdir()
    (run / "report" / "kl.png").write_bytes(b"stale")  # from an earlier report: must go
    path = write_report(str(run), stages=STAGES, samples=SAMPLES)
    assert path == str(run / "report" / "report.html")
    pngs = sorted(p.name for p in (run / "report").glob("*.png"))
    assert pngs == ["accuracy.png", "loss.png", "lr.png", "tokens_per_s.png"]  # no reward, no kl
    assert not [p for p in (run / "report").iterdir() if ".tmp" in p.name]
    page = open(path, encoding="utf-8").read()
    assert "http://" not in page and "https://" not in page
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == 4 and all(s.startswith("data:image/png;base64,") for s in srcs)
    inlined = {base64.b64decode(s.split(",", 1)[1]) for s in srcs}
    assert inlined == {(run / "report" / p).read_bytes() for p in pngs}  # the same images, inlined
    # config, stage values and samples appear escaped, never as raw markup
    assert "note: &quot;&lt;b&gt;bold&lt;/b&gt; &amp; co&quot;" in page and "<b>bold</b>" not in page
    assert "preset: demo-tiny" in page
    table = page[page.index('<table id="stages">'):]
    table = table[:table.index("</table>")]
    for cell in ("<th>stage</th>", "<th>accuracy</th>", "<th>kl</th>", "<th>seconds</th>",
                 ">sft<", ">0.41<", ">—<", ">80.2<", ">dpo<", ">0.5679<", ">0.0123<", ">95<"):
        assert cell in table, cell
    assert "12+30=&lt;" in page and "42 &amp; done&lt;/s&gt;" in page and "</s>" not in page
    # a second report of the same folder overwrites in place
    assert write_report(str(run)) == path and "Stages" not in open(path, encoding="utf-8").read()


def test_series_train_and_eval_lines(tmp_path):
    run = make_run(tmp_path)
    series = collect_series(read_metrics(str(run / "metrics.jsonl")))
    assert series["eval_loss"][0] == [10, 20, 30, 40]  # eval-only lines keep their own steps
    assert series["loss"][0] == list(range(2, 41, 2))
    recs = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan"), "note": "x"}, {"step": 1, "loss": 1.5}]
    assert collect_series(recs) == {"loss": ([1], [1.5])}  # NaN and strings dropped; a repeated step: later wins


def test_bad_metrics_line_names_file_and_line(tmp_path):
    run = make_run(tmp_path)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines.insert(2, '{"step": 6, "loss": 1.0')  # truncated JSON on line 3
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(PosttrainError, match=re.escape(f"{metrics}:3:")):
        write_report(str(run))
    lines[2] = '{"loss": 1.0}'  # no step
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(PosttrainError, match=re.escape(f"{metrics}:3:") + ".*step"):
        write_report(str(run))
    metrics.unlink()
    with pytest.raises(PosttrainError, match=re.escape(str(metrics))):
        write_report(str(run))


def _near(img, hex_colour, tol=0.12):
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return np.all(np.abs(img[..., :3] - rgb) < tol, axis=-1)


@pytest.mark.slow
def test_report_renders_in_headless_chromium(tmp_path):
    import matplotlib.image

    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.fail("no headless browser found (chromium / chromium-browser / google-chrome): "
                    "install Debian's chromium package (.ci/run does): apt-get install -y chromium")
    run = make_run(tmp_path)
    path = write_report(str(run), stages=STAGES, samples=SAMPLES)
    shot = tmp_path / "shot.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--hide-scrollbars", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           f"--screenshot={shot}", "--window-size=1200,2400", "file://" + os.path.abspath(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert shot.exists(), f"chromium wrote no screenshot (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
    img = matplotlib.image.imread(str(shot))  # float RGB(A) in [0, 1]
    assert img.shape[:2] == (2400, 1200)
    ink = np.any(img[..., :3] < 0.9, axis=-1)
    assert ink.mean() > 0.01, "the screenshot is (nearly) blank"
    # Every plot draws its first line in matplotlib's C0 (#1f77b4); the page itself has no blue.
    c0 = _near(img, "#1f77b4")
    assert c0.sum() > 2000, f"only {c0.sum()} plot-line pixels in the screenshot"
    # ... in both columns of the plot grid (four plots, two a row), not one stray block
    ys, xs = np.nonzero(c0)
    assert (xs < 600).sum() > 500 and (xs >= 600).sum() > 500
    assert _near(img, "#ff7f0e").sum() > 100  # C1: the accuracy plot's second series (eval agreement)
