"""Every code block in README.md and docs/guides/ runs, so the docs cannot drift from the code.

bash blocks: each command (backslash continuations joined, comments dropped) runs in-process
through `posttrain.cli.main` and must exit 0; a `make TARGET` line must be a target `make -n`
accepts (`make demo` itself runs in test_cli as `posttrain demo --quick`; `make test` is this
suite). python blocks run with `exec`, the blocks of one document sharing their names. yaml
blocks are run configs: built with the typed config (a pipeline file: every stage), not trained.
Everything runs in a scratch folder with `configs/` and `tests/` linked in, so `runs/` lands there;
the documents run in turn in one test (one folder). A command runs at most twice: its first run, and
its first repeat (a finished run run again: "already finished", a finished pipeline's stages skipped,
an export written again); a later copy of the same text in another guide (`posttrain sft --config
configs/sft_tiny.yaml` opens five of them) is the same command on the same folder again, so it is
matched against the runs before and not run a third time.
"""

import glob
import os
import re
import shlex
import subprocess
import time

import pytest

from posttrain import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs/guides/*.md")))]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def blocks(doc: str) -> list[tuple[str, str, int]]:
    """(language, code, line) of each fenced block."""
    text = open(os.path.join(ROOT, doc)).read()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in BLOCK.finditer(text)]


def commands(code: str) -> list[str]:
    return [c for c in (" ".join(shlex.split(line, comments=True)) for line in code.replace("\\\n", " ").splitlines())
            if c]


def test_the_guides_cover_every_trainer_and_have_code():
    names = {os.path.basename(d)[:-3] for d in DOCS[1:]}
    assert {"sft", "dpo", "kto", "online_dpo", "reward_model", "grpo", "ppo", "distill", "pipeline"} <= names
    for doc in DOCS:
        assert any(lang in ("bash", "python") for lang, _, _ in blocks(doc)), doc


def test_code_blocks_run(tmp_path, monkeypatch, capsys):
    """Every document in turn, in one scratch folder (a command two documents give runs once)."""
    for name in ("configs", "tests"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    monkeypatch.chdir(tmp_path)
    ran: dict[str, list[str]] = {}  # command -> where it ran
    for doc in DOCS:
        _run_doc(doc, tmp_path, capsys, ran)


def _run_doc(doc, scratch, capsys, ran):
    namespace: dict = {"__name__": "__doc__"}
    for lang, code, line in blocks(doc):
        where = f"{doc}:{line}"
        if lang == "bash":
            for cmd in commands(code):
                argv = shlex.split(cmd)
                if argv[0] == "make":
                    done = subprocess.run(["make", "-n", "-C", ROOT, *argv[1:]], capture_output=True, text=True)
                    assert done.returncode == 0, f"{where}: {cmd}: {done.stderr}"
                    continue
                assert argv[0] in (".venv/bin/posttrain", "posttrain"), f"{where}: not a posttrain command: {cmd}"
                if len(ran.get(cmd, [])) >= 2:  # its first run and its repeat passed: the same command again
                    print(f"[docs]    --    {where}: {cmd} (ran at {' and '.join(ran[cmd])})")
                    continue
                ran.setdefault(cmd, []).append(where)
                t0 = time.perf_counter()
                rc = cli.main(argv[1:])
                print(f"[docs] {time.perf_counter() - t0:6.1f} s  {where}: {cmd}")
                assert rc == 0, f"{where}: `{cmd}` exited {rc}: {capsys.readouterr().err[-2000:]}"
        elif lang == "python":
            t0 = time.perf_counter()
            exec(compile(code, where, "exec"), namespace)
            print(f"[docs] {time.perf_counter() - t0:6.1f} s  {where}: python block")
        elif lang == "yaml":
            import yaml

            from posttrain import config as C
            from posttrain.pipeline import Pipeline
            from posttrain.runs import config_recipe
            from posttrain.trainers import recipe_class

            folder = scratch / "doc_yaml"  # the block beside links to configs/*.yaml (its `config:` files)
            if not folder.exists():
                folder.mkdir()
                for f in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
                    os.symlink(f, folder / os.path.basename(f))
            path = folder / f"{os.path.basename(doc)}_{line}.yaml"
            path.write_text(code)
            if "stages" in yaml.safe_load(code):
                assert Pipeline.from_yaml(str(path), progress=False).stages  # every stage's config built
            else:
                C.load(recipe_class(config_recipe(str(path))).config_class, str(path))
        else:
            pytest.fail(f"{where}: a ```{lang} block; the docs test runs bash, python and yaml blocks only")


PATH_DOCS = ["README.md", "docs/ARCHITECTURE.md", "docs/READING_ORDER.md"]
NAMED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md|yaml|sh|json|toml|lock)|(?:[\w-]+/)+)(?![\w/-])")


def _tree_paths(text: str) -> list[str]:
    """The paths of ARCHITECTURE.md's package map: names in its first code block, nested by indentation."""
    block = text.split("```")[1].splitlines()[1:]
    stack: list[tuple[int, str]] = []
    out = []
    for line in block:
        name = line.strip().split(" ")[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        if not name or not (name.endswith("/") or "." in name) or indent % 2:
            continue  # a continuation line of a description
        if indent > 21:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(p for _, p in stack) + name
        out.append(path)
        if name.endswith("/"):
            stack.append((indent, name))
    return out


def test_architecture_map_names_existing_files():
    paths = _tree_paths(open(os.path.join(ROOT, "docs/ARCHITECTURE.md")).read())
    assert len(paths) > 100 and "posttrain/recipes/recipe.py" in paths
    assert [p for p in paths if not os.path.exists(os.path.join(ROOT, p))] == []


@pytest.mark.parametrize("doc", PATH_DOCS)
def test_paths_named_in_the_docs_exist(doc):
    """Every file or folder a doc names in backticks exists (relative to the repository, posttrain/,
    tests/ or docs/, as the docs write them; a bare file name exists somewhere in the repository)."""
    names = {f for top in ("posttrain", "tests", "docs", "configs", "benchmarks", "scripts")
             for _, _, files in os.walk(os.path.join(ROOT, top)) for f in files}
    missing = []
    for quoted in re.findall(r"`([^`\n]+)`", open(os.path.join(ROOT, doc)).read()):
        for name in NAMED.findall(quoted):
            if "*" in name or "<" in name or name.startswith(("runs/", ".cache/", "../")):
                continue
            if "/" not in name.rstrip("/") and name in names:  # a bare file name, e.g. after its folder's path
                continue
            if not any(os.path.exists(os.path.join(ROOT, base, name)) for base in ("", "posttrain", "tests", "docs")):
                missing.append(name)
    assert missing == []
