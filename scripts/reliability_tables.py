"""Rewrite docs/reliability.md's bad-input and fault tables from a run of their tests.

    .venv/bin/python scripts/reliability_tables.py    # ~5 minutes on 2 cores

Runs tests/reliability/test_bad_input.py and test_faults.py with POSTTRAIN_RELIABILITY_OUT set (each
test records its measured outcome), then renders both tables from those outcomes
(tests/reliability/tables.py) into the doc. Refuses to write when a test failed or an outcome is missing.
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reliability"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import tables  # noqa: E402
from bad_inputs import CASES  # noqa: E402


def main() -> int:
    from test_faults import RECIPES

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "outcomes.jsonl")
        env = {**os.environ, "POSTTRAIN_RELIABILITY_OUT": out}
        env.pop("POSTTRAIN_FAULT_SEED", None)  # the documented run draws each trainer's faults from its name
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
                              "tests/reliability/test_bad_input.py", "tests/reliability/test_faults.py",
                              # the checks of the doc this run rewrites
                              "--deselect", "tests/reliability/test_bad_input.py::test_doc_table_is_the_catalogues",
                              "--deselect", "tests/reliability/test_faults.py::test_fault_table_in_the_docs"],
                             cwd=ROOT, env=env)
        records = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    if rc != 0:
        print(f"reliability_tables: the tests failed (exit {rc}); the doc is left as it is", file=sys.stderr)
        return 1
    bad = {r["key"]: r["outcome"] for r in records if r["table"] == "bad_input"}
    faults = {r["key"]: r["outcome"] for r in records if r["table"] == "faults"}
    missing = [c.id for c in CASES if c.id not in bad] + [t for t in RECIPES if t not in faults]
    if missing:
        print(f"reliability_tables: no outcome for {missing}; the doc is left as it is", file=sys.stderr)
        return 1
    text = open(tables.DOC).read()
    head, _, tail = tables.bad_input_section(text)
    text = f"{head}{tables.BAD_BEGIN}\n{tables.render_bad_inputs(CASES, bad)}{tables.BAD_END}{tail}"
    head, _, tail = tables.fault_section(text)
    text = f"{head}{tables.FAULT_MARK}\n{tables.render_faults(list(RECIPES), faults)}\n\n{tail}"
    with open(tables.DOC, "w") as fh:
        fh.write(text)
    print(f"reliability_tables: wrote {tables.DOC} ({len(bad)} bad inputs, {len(faults)} trainers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
