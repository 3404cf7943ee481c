"""`uv run count_lines`: the lines a reader reads (non-blank, not a comment line; docstrings count) per folder of the
package, then what a default `finetune sft` loads (measured by running one step of it), then the whole package."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

GOAL, FILE_LIMIT = 4000, 300
PACKAGE = Path(__file__).resolve().parent.parent
# one optimizer step of the embedded default (its preset, data and held-out evaluation), in a fresh interpreter; the
# package's modules in sys.modules at its end are what the run loaded
DEFAULT_RUN = """
import json, sys
sys.argv = ["finetune", "sft", "train.max_steps=1", "eval.num_samples=1", "-o", sys.argv[1]]
from finetune.cli import main
try:
    main()
finally:
    files = [getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n.split(".")[0] == "finetune"]
    print("MODULES " + json.dumps(sorted(f for f in files if f)), file=sys.__stdout__, flush=True)
"""


def counted_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if not re.fullmatch(r"\s*(#.*)?", line))


def default_run_modules(root: Path = PACKAGE) -> list[Path]:
    """The package's files that one step of the default `finetune sft` loads (run from the repo, as a user would)."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-c", DEFAULT_RUN, str(Path(out) / "run")], cwd=root.parent,
                              capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("MODULES ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"count_lines: the default run failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return [Path(f) for f in json.loads(lines[-1].removeprefix("MODULES "))]


def main(root: Path = PACKAGE) -> None:
    files = sorted(root.rglob("*.py"))
    for folder in sorted({p.parent for p in files}):
        print(f"{folder.relative_to(root.parent)}/:")
        for p in (p for p in files if p.parent == folder):
            n = counted_lines(p)
            print(f"  {n:5d}  {p.name}" + (f"  (over {FILE_LIMIT})" if n > FILE_LIMIT else ""))
    loaded = default_run_modules(root)
    print(f"default sft run: {sum(map(counted_lines, loaded))} lines in {len(loaded)} modules (goal <= {GOAL})")
    print(f"package: {sum(map(counted_lines, files))} lines in {len(files)} modules")


if __name__ == "__main__":
    main()
