"""`uv run count_lines`: the lines a reader reads (non-blank, not a comment line; docstrings count) of each file of the
core (finetune/ outside ext/) and of the extensions (finetune/ext/), then the totals against the core's goal."""
from __future__ import annotations

import re
from pathlib import Path

GOAL, FILE_LIMIT = 3000, 300
PACKAGE = Path(__file__).resolve().parent.parent


def counted_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if not re.fullmatch(r"\s*(#.*)?", line))


def main(root: Path = PACKAGE) -> None:
    files = sorted(root.rglob("*.py"))
    layers = {"core": [p for p in files if "ext" not in p.relative_to(root).parts[:1]],
              "ext": [p for p in files if p.relative_to(root).parts[0] == "ext"]}
    totals = {}
    for layer, paths in layers.items():
        print(f"{layer}:")
        for p in paths:
            n = counted_lines(p)
            print(f"  {n:5d}  {p.relative_to(root.parent)}" + (f"  (over {FILE_LIMIT})" if n > FILE_LIMIT else ""))
        totals[layer] = sum(map(counted_lines, paths))
    print(f"core: {totals['core']} lines in {len(layers['core'])} files (goal < {GOAL}); ext: {totals['ext']} lines")


if __name__ == "__main__":
    main()
