"""Render README's compatibility tables from the last full test run.

`make test` leaves .cache/compat-results.json: for each writer release (a megatron-core
version, or "nvidia-resiliency-ext 0.3.0") and each torch release, what the tests marked
``@pytest.mark.compat(version, what)`` verified there, and whether it passed.
`python3 tools/compat_table.py` prints the tables; `--update-readme` rewrites the block
between the compat markers in README.md.

The first table is megatron-core releases x real torch releases: each cell says what the
fix does for that pair (what it supplies, or "native": nothing is missing and the writer is
left untouched) and whether every check of that cell passed. The second lists the other
checks, with the torch releases they ran on.
"""

import json
import os
import re
import sys
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, ".cache", "compat-results.json")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"
# What every cell of the first table is made of (tests/test_e2e_save.py).
MATRIX_CHECKS = (
    "with the wheel: round trip equal, `.distcp` bytes = native 0.13.1, status",
    "`MCORE_AUTOPATCH=0`: fails as that torch fails, or saves natively",
    "left untouched; saves natively; status",
)

Results = Dict[str, Dict[str, Dict[str, str]]]  # release -> torch -> what -> passed/failed/skipped


def release(version: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def supplied(version: str, torch: str) -> str:
    """What the fix supplies for megatron-core ``version`` on ``torch``; "native" for nothing."""
    m, t = release(version), release(torch)
    missing = []
    if t >= (2, 7) and m < (0, 12):
        missing.append("`transforms`")
    if t >= (2, 8) and m < (0, 13):
        missing.append("`serialization_format`")
    return " + ".join(missing) or "native"


def mark(outcomes: List[str]) -> str:
    if "failed" in outcomes:
        return "❌"
    return "✅" if outcomes and all(o == "passed" for o in outcomes) else "-"


def matrix(results: Results) -> str:
    torches = sorted({t for by_torch in results.values() for t in by_torch}, key=release)
    lines = [
        "| megatron-core | %s |" % " | ".join("torch %s" % t for t in torches),
        "|---|" + "---|" * len(torches),
    ]
    rows = [v for v in results if v[:1].isdigit() and any(set(c) & set(MATRIX_CHECKS) for c in results[v].values())]
    for version in sorted(rows, key=release):
        cells = []
        for torch in torches:
            checks = {w: o for w, o in results[version].get(torch, {}).items() if w in MATRIX_CHECKS}
            cells.append("%s %s" % (mark(list(checks.values())), supplied(version, torch)) if checks else "")
        lines.append("| %s | %s |" % (version, " | ".join(cells)))
    return "\n".join(lines)


def details(results: Results) -> str:
    def by_release(label: str) -> Tuple[int, Tuple[int, ...]]:
        return (0 if label[:1].isdigit() else 1, release(label))

    lines = ["| release | also verified (torch releases) |", "|---|---|"]
    for label in sorted(results, key=by_release):
        whats: Dict[str, List[Tuple[str, str]]] = {}
        for torch, checks in results[label].items():
            for what, outcome in checks.items():
                if what not in MATRIX_CHECKS:
                    whats.setdefault(what, []).append((torch, outcome))
        if not whats:
            continue
        cells = []
        for what in sorted(whats):
            runs = sorted(whats[what], key=lambda run: release(run[0]))
            cells.append("%s %s (%s)" % (mark([o for _, o in runs]), what, ", ".join(t for t, _ in runs)))
        lines.append("| %s | %s |" % (label, "; ".join(cells)))
    return "\n".join(lines)


def render(results: Results) -> str:
    return "\n".join(
        [
            matrix(results),
            "",
            "Each cell: ✅ = every check of that pair passed (❌ = one failed; empty = not run):",
            "with the wheel installed, the save and load round trip is equal and the `.distcp` bytes",
            "equal native megatron-core 0.13.1's on the same torch, and `status` of the process that",
            "saved says needed / applied / reason right; with `MCORE_AUTOPATCH=0` the save fails the",
            "way that torch fails, or saves natively where nothing is missing. The text says what the",
            "fix supplies there; *native* = nothing is missing, and the writer is left untouched.",
            "",
            details(results),
        ]
    )


def main(argv: "list[str]") -> int:
    try:
        with open(RESULTS) as f:
            results = json.load(f)
    except OSError:
        print("no %s: run `make test` first" % os.path.relpath(RESULTS, ROOT), file=sys.stderr)
        return 1
    table = render(results)
    if "--update-readme" not in argv:
        print(table)
        return 0
    with open(README) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        print("README.md has no %s ... %s block" % (BEGIN, END), file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(README, "w") as f:
        f.write(head + BEGIN + "\n" + table + "\n" + END + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
