"""Render README's compatibility table from the last full test run.

`make test` leaves .cache/compat-results.json: for each megatron-core release, what the
tests marked ``@pytest.mark.compat(version, what)`` verified, and whether they passed.
`python3 tools/compat_table.py` prints the table; `--update-readme` rewrites the block
between the compat markers in README.md.
"""

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, ".cache", "compat-results.json")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"


def release(version: str) -> "tuple[int, ...]":
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def what_is_supplied(version: str) -> str:
    if release(version) < (0, 12):
        return "`transforms` + `serialization_format`"
    if release(version) < (0, 13):
        return "`serialization_format`"
    return "nothing (not patched)"


def render(results: "dict[str, dict[str, str]]") -> str:
    lines = [
        "| megatron-core | the fix supplies (torch 2.8+) | verified by `make test` (torch 2.13.0 CPU, gloo) |",
        "|---|---|---|",
    ]
    for version in sorted(results, key=release):
        cells = "; ".join(
            ("✅ " if outcome == "passed" else "❌ ") + what for what, outcome in sorted(results[version].items())
        )
        lines.append("| %s | %s | %s |" % (version, what_is_supplied(version), cells))
    return "\n".join(lines)


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
