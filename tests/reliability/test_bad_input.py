"""The bad-input catalogue (issue #15): one broken input per case, run through the CLI in-process.

Each case breaks one thing in a valid tiny setup (configs/*_tiny.yaml, tests/data, a tiny Hugging Face
folder) and expects: exit code 2, one `posttrain: error:` message naming the key or FILE:LINE and the fix
(the case's `expect` fragments), no traceback (unless `--debug`), and nothing half-written: no new file
anywhere under the case's folder (no run folder contents, no checkpoint, no weights, no export) and every
file that was there before unchanged (bytes lost 0).

The measured outcomes fill the table in docs/reliability.md through scripts/reliability_tables.py
(`tables.record`); `test_doc_table_is_the_catalogues` checks the table against the catalogue.
Every case fails before any compilation, so the file runs in seconds.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from posttrain.cli import main

sys.path.insert(0, os.path.dirname(__file__))
import tables  # noqa: E402
from bad_inputs import CASES, Case, tokenizer_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- running a case


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The shared model folders: {hf} (a 1-layer Llama, vocabulary 264, the byte tokenizer) and {small}
    (a Llama with a 97-token vocabulary, no tokenizer), built once with transformers."""
    import torch
    from hf_models import hf_config, make_checkpoint
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    cfg = hf_config("llama")
    cfg.vocab_size, cfg.num_hidden_layers = 264, 1
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(root / "hf")
    tokenizer_folder()(root / "hf")
    return {"hf": str(root / "hf"), "small": make_checkpoint("llama", root / "small")}


def fill(text: str, places: dict) -> str:
    for key, value in places.items():
        text = text.replace("{" + key + "}", value)
    return text


def snapshot(roots) -> dict:
    """path -> (size, sha1) of every file under `roots`."""
    out = {}
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as fh:
                    out[path] = (os.path.getsize(path), hashlib.sha1(fh.read()).hexdigest())
    return out


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.id, marks=marks)


def test_catalogue_is_large_and_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30
    assert {c.category for c in CASES} == {"config", "data", "model", "tokenizer", "reward", "pipeline", "checkpoint"}


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case, models, tmp_path, capsys, monkeypatch):
    places = {"t": str(tmp_path), "cfg": str(REPO / "configs"), **models}
    monkeypatch.chdir(REPO)  # the tiny configs name tests/data/... relative to the repository
    monkeypatch.syspath_prepend(str(tmp_path))  # reward modules written for the case
    for rel, content in case.files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(path)
            for written in ([path] if path.is_file() else path.rglob("*.yaml")):  # placeholders in run configs
                if written.suffix == ".yaml":
                    written.write_text(fill(written.read_text(), places))
        else:
            path.write_text(fill(content, places))
    roots = [tmp_path, models["hf"], models["small"]]
    before = snapshot(roots)
    argv = [fill(a, places) for a in case.argv]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    except Exception as e:  # a bug: recorded, then re-raised with its traceback
        tables.record("bad_input", case.id, {"rc": f"raised {type(e).__name__}", "survived": False, "bytes_lost": 0})
        raise
    err = capsys.readouterr().err
    after = snapshot(roots)
    lost = sum(size for path, (size, digest) in before.items() if after.get(path, (None, None))[1] != digest)
    new = sorted(os.path.relpath(p, tmp_path) for p in set(after) - set(before))
    debug = "--debug" in argv
    expect = [fill(e, places) for e in case.expect]
    missing = [e for e in expect if e not in err]
    survived = rc == 2 and not missing and not new and not lost and (debug or "Traceback" not in err)
    tables.record("bad_input", case.id, {"rc": rc, "survived": survived, "bytes_lost": lost})
    assert rc == 2, f"exit code {rc}; stderr:\n{err}"
    assert not missing, f"message lacks {missing}; stderr:\n{err}"
    assert ("Traceback" in err) == debug, err
    assert sum(": error: " in line for line in err.splitlines()) == 1, f"not one error message:\n{err}"
    assert not new, f"files written by a failed run: {new}"
    assert lost == 0, f"{lost} bytes of existing files changed or removed"


# ----------------------------------------------------------------------------- docs/reliability.md


def test_doc_table_is_the_catalogues():
    """docs/reliability.md's bad-input table (written by scripts/reliability_tables.py from a run's measured
    outcomes) has one row per case of the catalogue, each as a passing run of the case above measures it:
    exit code 2, survived, 0 bytes lost (a strict-xfail case: "known gap")."""
    _, table, _ = tables.bad_input_section(open(tables.DOC).read())
    expected = tables.render_bad_inputs(CASES, {c.id: {"rc": 2, "survived": not c.xfail, "bytes_lost": 0}
                                                for c in CASES})
    rows = {ln.split("|")[1].strip(): ln for ln in table.splitlines() if ln.startswith("| ")}
    for line in expected.splitlines():
        if not line.startswith("| ") or line.startswith(("| case ", "| category ")):
            continue
        key = line.split("|")[1].strip()
        case = next((c for c in CASES if c.id == key), None)
        if case is not None and case.xfail:  # its exit code is whatever the gap gives: the row's other cells
            assert rows.get(key, "").startswith(line.rsplit("|", 4)[0]), key
        else:
            assert rows.get(key) == line, f"row {key!r} is not {line!r}: run scripts/reliability_tables.py"
    assert set(rows) == {ln.split("|")[1].strip() for ln in expected.splitlines() if ln.startswith("| ")}
