"""Compare two outputs of benchmarks/equivalence.py: print every case whose manifest entry differs (or is only in one)
and exit 1 if any does, else 0.

    python benchmarks/equivalence_compare.py OUT_A OUT_B [--rtol 0] [--ignore REGEX] [--tolerant]

Values are compared exactly by default. --rtol R compares numbers inside JSON values (metrics, eval) with that
relative tolerance. --tolerant applies the tolerances recorded as needed for this harness (TOLERANT below: cases seen
to differ between two identical runs of the same checkout) instead of requiring them bit-exact. --common compares
only the keys both manifests hold (a partial run with --only). --ignore REGEX
leaves out matching keys (e.g. cases a change removed on purpose). Where the raw outputs differ, the first differing
line of each side's normalised stdout is shown.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from pathlib import Path

# Cases found nondeterministic between two runs of the same checkout: {key regex: rtol}; rtol None = skip the key.
# None at 93647d2 (two runs, --jobs 1 and 2: every entry equal) once equivalence.py normalises DCP's .metadata (a
# random save_id and the checkpoint path) and the marker's sha256 of it; left here for a platform that needs one.
TOLERANT: dict[str, float | None] = {}


def close(a, b, rtol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if rtol == 0:
            return a == b
        return math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-3) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], rtol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, rtol) for x, y in zip(a, b))
    return a == b


def show(v, width: int = 160) -> str:
    s = json.dumps(v)
    return s if len(s) <= width else s[:width] + "..."


def raw_hint(a: Path, b: Path, key: str) -> str:
    """The first differing line of the case's normalised (or raw) stdout/stderr in both outputs."""
    case, _, field = key.partition(":")
    if field not in ("stdout", "stderr"):
        return ""
    base = case.replace("/", "__") + (".out" if field == "stdout" else ".err")
    for suffix in (".norm", ""):
        fa, fb = a / "raw" / (base + suffix), b / "raw" / (base + suffix)
        if field == "stdout" and suffix == "" and (a / "raw" / (base + ".norm")).exists():
            continue
        if fa.exists() and fb.exists():
            la, lb = fa.read_text(errors="replace").splitlines(), fb.read_text(errors="replace").splitlines()
            for op in difflib.SequenceMatcher(None, la, lb, autojunk=False).get_opcodes():
                if op[0] != "equal":
                    return (f"\n      A line {op[1] + 1}: {(la[op[1]:op[2]] or [''])[0][:200]!r}"
                            f"\n      B line {op[3] + 1}: {(lb[op[3]:op[4]] or [''])[0][:200]!r}")
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for numbers in JSON values")
    ap.add_argument("--tolerant", action="store_true", help="use the recorded per-case tolerances (TOLERANT)")
    ap.add_argument("--ignore", action="append", default=[], help="regex of keys to leave out (repeatable)")
    ap.add_argument("--common", action="store_true", help="only the keys both have (a partial run, --only)")
    args = ap.parse_args()
    ma = json.loads((args.a / "manifest.json").read_text())
    mb = json.loads((args.b / "manifest.json").read_text())
    ignore = [re.compile(r) for r in args.ignore]
    tolerant = {re.compile(k): v for k, v in TOLERANT.items()} if args.tolerant else {}
    differ = 0
    keys = sorted(set(ma) & set(mb) if args.common else set(ma) | set(mb))
    for key in keys:
        if key.startswith("_inputs/") and key in ma and key in mb and ma[key] != mb[key]:
            print(f"INPUTS DIFFER {key}: the two runs used different --models dirs")
            differ += 1
            continue
        if any(r.search(key) for r in ignore) or (args.common and (key not in ma or key not in mb)):
            continue
        if key not in ma or key not in mb:
            print(f"ONLY IN {'A' if key in ma else 'B'}: {key} = {show(ma.get(key, mb.get(key)))}")
            differ += 1
            continue
        rtol = args.rtol
        for r, tol in tolerant.items():
            if r.search(key):
                rtol = tol
        if rtol is None:
            continue
        if not close(ma[key], mb[key], rtol):
            va, vb = ma[key], mb[key]
            where = ""
            if isinstance(va, list) and isinstance(vb, list):  # metrics: the first differing step
                i = next((i for i, (x, y) in enumerate(zip(va, vb)) if not close(x, y, rtol)), min(len(va), len(vb)))
                where, va, vb = f" (item {i} of {len(va)} / {len(vb)})", va[i:i + 1], vb[i:i + 1]
            print(f"DIFFERS {key}{where}\n    A: {show(va, 400)}\n    B: {show(vb, 400)}"
                  f"{raw_hint(args.a, args.b, key)}")
            differ += 1
    print(f"{differ} of {len(keys)} entries differ ({args.a} vs {args.b})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
