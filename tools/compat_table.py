"""Render the compatibility tables (docs/compatibility.md) from the last full test run.

`make test` and `make test-matrix` each leave .cache/compat-results-<tier>.json: for each
writer release (a megatron-core version, or "nvidia-resiliency-ext 0.3.0") and each torch
release, what the tests marked ``@pytest.mark.compat(version, what)`` verified there, and
whether it passed.
`python3 tools/compat_table.py` prints the tables; `--update` rewrites the block between
the compat markers in docs/compatibility.md (`make compat-table`).

The first table is megatron-core releases x real torch releases. Each cell has two marks,
*save* (the plain round trips of tests/test_e2e_save.py) and *resume* (a training job's
checkpoint path with model and distributed-optimizer state, tests/test_e2e_job_path.py), and
says what the fixes do for that pair. The second lists the other checks, with the torch
releases they ran on.
"""

import json
import os
import re
import sys
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, ".cache", "compat-results.json")
PAGE = os.path.join(ROOT, "docs", "compatibility.md")
BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"
# The checks behind each mark of the first table (the test files name them).
SAVE_CHECKS = (
    "with the wheel: round trip equal, `.distcp` bytes = native 0.13.1, status",
    "`MCORE_AUTOPATCH=0`: fails as that torch fails, or saves natively",
    "left untouched; saves natively; status",
)
RESUME_CHECKS = (
    "job path: 3 async saves, resume, model + distributed-optimizer state equal",
    "job path: resume on another data-parallel split (reshards flattened tensors)",
    "job path, `MCORE_AUTOPATCH=0`: fails as today, or works natively",
    "`selftest`: plain + distributed-optimizer state, `mcore_data` kept",
    "job path on a fresh stack: saves, resumes equal (Namespace args, rng_state)",
    "job path on a fresh stack, without the package: fails as upstream fails",
)
MATRIX_CHECKS = SAVE_CHECKS + RESUME_CHECKS
ENVIRONMENTS = os.path.join(ROOT, ".cache", "compat-environments.json")
TIERS = ("everyday", "matrix")  # tests/conftest.py: `make test`, `make test-matrix`
# Merging the tiers' verdicts for one check: a failure anywhere stands, a pass beats a skip.
VERDICT_RANK = {"skipped": 0, "passed": 1, "failed": 2}

Results = Dict[str, Dict[str, Dict[str, str]]]  # release -> venv key -> what -> passed/failed/skipped
# venv key ("2.9.0", "2.9.0-numpy2", "py312") -> {"torch", "python", "numpy", "setuptools"}
Environments = Dict[str, Dict[str, str]]


def release(version: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def supplied(version: str, env: Dict[str, str]) -> str:
    """What the fixes do for megatron-core ``version`` in the venv ``env``; "native" for nothing."""
    m, t = release(version), release(env.get("torch", "0"))
    numpy, setuptools = release(env.get("numpy", "1")), release(env.get("setuptools", "0"))
    parts = []
    if t >= (2, 7) and m < (0, 12):
        parts.append("`transforms`")
    if t >= (2, 8) and m < (0, 13):
        parts.append("`serialization_format`")
    if (2, 9) <= t < (2, 12) and (0, 8) <= m < (0, 15):
        parts.append("keeps `mcore_data`")
    if numpy >= (2,) and m < (0, 16):
        parts.append("`numpy.product`")
    if t >= (2, 6) and m < (0, 11):
        parts.append("`weights_only`")
    if (0, 7) <= m < (0, 9) and (setuptools >= (81,) or (70,) <= setuptools < (71,)):
        parts.append("`pkg_resources`")
    if t >= (2, 4) and m < (0, 9):
        parts.append("ShardedObjects once")
    return " + ".join(parts) or "native"


def mark(outcomes: List[str]) -> str:
    if "failed" in outcomes:
        return "❌"
    return "✅" if outcomes and all(o == "passed" for o in outcomes) else "-"


def column_of(key: str, envs: Environments) -> str:
    """The table column of a venv key: its torch release, and the CPython when not 3.11."""
    env = envs.get(key, {})
    torch = env.get("torch") or key.split("-")[0]
    python = env.get("python", "3.11")
    return "torch %s" % torch if python.startswith("3.11") else "torch %s, CPython %s" % (torch, python[:4])


def matrix(results: Results, envs: Environments) -> str:
    keys = sorted({k for by_key in results.values() for k in by_key}, key=lambda k: release(column_of(k, envs)))
    columns = list(dict.fromkeys(column_of(k, envs) for k in keys))
    lines = ["| megatron-core | %s |" % " | ".join(columns), "|---|" + "---|" * len(columns)]
    rows = [v for v in results if v[:1].isdigit() and any(set(c) & set(MATRIX_CHECKS) for c in results[v].values())]
    for version in sorted(rows, key=release):
        cells = []
        for column in columns:
            parts = []
            for key in [k for k in keys if column_of(k, envs) == column]:
                checks = results[version].get(key, {})
                # A job that resumes saved first: the job path's checks count for both marks.
                save = [o for w, o in checks.items() if w in MATRIX_CHECKS]
                resume = [o for w, o in checks.items() if w in RESUME_CHECKS]
                if not save and not resume:
                    continue
                env = envs.get(key, {"torch": key.split("-")[0]})
                if resume:
                    marks = "%s save %s resume" % (mark(save), mark(resume))
                else:  # the plain round trip: saved and loaded back in the same process
                    marks = "%s save + load" % mark(save)
                parts.append("numpy %s: %s · %s" % (env.get("numpy", "?"), marks, supplied(version, env)))
            cells.append("<br>".join(parts))
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


def render(results: Results, envs: Environments) -> str:
    return "\n".join(
        [
            matrix(results, envs),
            "",
            "Each cell names the numpy of each venv that ran there (the torch venvs: numpy 1.26.4 and the",
            "setuptools torch leaves, an old image; the fresh venvs: numpy 2.4.6 or 1.26.4 with setuptools",
            "84.2.1, a new one). **save + load** ✅: the plain round trip, one process that saves and loads",
            "back equal, its `.distcp` bytes equal native megatron-core 0.13.1's on the same torch and",
            "`status` of the saving process right, and with `MCORE_AUTOPATCH=0` it fails the way that torch",
            "fails or saves natively where nothing is missing. **save** ✅ **resume** ✅: a training job's",
            "checkpoint path with model and distributed-optimizer state, as that release's Megatron-LM ran",
            "it (2 gloo ranks, async saves through the fully parallel wrapper where the release has them),",
            "saved, then resumed equal by a fresh 2-rank job; without the package it fails as upstream",
            "does. The text says what the fixes do there; *native* = nothing is missing and nothing is",
            "rebound. Empty: not run for that pair (see below the table).",
            "",
            details(results),
        ]
    )


def tier_files(path: str) -> "list[str]":
    """``compat-results.json`` -> the ``compat-results-<tier>.json`` files that exist."""
    stem, ext = os.path.splitext(path)
    return [f for f in ("%s-%s%s" % (stem, tier, ext) for tier in TIERS) if os.path.exists(f)]


def merged(paths: "list[str]") -> Dict[str, Dict[str, Dict[str, str]]]:
    """The tiers' results together; a check that failed in one tier stays failed."""
    out: Dict[str, Dict[str, Dict[str, str]]] = {}
    for path in paths:
        with open(path) as f:
            for version, by_key in json.load(f).items():
                for key, checks in by_key.items():
                    cell = out.setdefault(version, {}).setdefault(key, {})
                    for what, verdict in checks.items():
                        if VERDICT_RANK[verdict] > VERDICT_RANK.get(cell.get(what, ""), -1):
                            cell[what] = verdict
    return out


def main(argv: "list[str]") -> int:
    paths = tier_files(RESULTS)
    if not paths:
        print(
            "no %s: run `make test` first" % os.path.relpath(RESULTS, ROOT).replace(".json", "-<tier>.json"),
            file=sys.stderr,
        )
        return 1
    results = merged(paths)
    environments: Environments = {}
    for path in tier_files(ENVIRONMENTS):
        with open(path) as f:
            environments.update(json.load(f))
    table = render(results, environments)
    if "--update" not in argv:
        print(table)
        return 0
    with open(PAGE) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        print("%s has no %s ... %s block" % (os.path.relpath(PAGE, ROOT), BEGIN, END), file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(PAGE, "w") as f:
        f.write(head + BEGIN + "\n" + table + "\n" + END + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
