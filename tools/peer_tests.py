"""``make peer-tests``: Megatron-LM's own dist_checkpointing tests, as a check of ours.

Runs ``tests/unit_tests/dist_checkpointing/<file>`` of a Megatron-LM checkout (its megatron-core
and its tests, unchanged; the seed's tag, core_v0.12.1, by default) on 8 CPU ranks
(``torch.distributed.run``, gloo) with torch 2.15.0 and numpy 2 and this checkout's wheel
installed, then prints one row per test: passed, or failed with the reason, named as ours
(a fix missing), CUDA-only, an optional dependency missing, or the test's own.

    MEGATRON_LM=/path/to/Megatron-LM make peer-tests
    python3 tools/peer_tests.py --megatron-lm PATH [--file test_serialization.py ...] [--ranks 8]

No checkout is fetched or built here: the checkout is the caller's (``git clone
https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.12.1``). CI has no
network but the package registries, so this target is not part of ``make test-matrix``.
stdout: the table (Markdown); progress on stderr; the merged results in
``.cache/peer-tests.json``.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import envs

PEER_VENV = os.path.join(envs.CACHE, "peer-venv")
PLUGIN_DIR = os.path.join(envs.ROOT, "tests", "peer")
RESULTS = os.path.join(envs.CACHE, "peer-tests.json")
DEFAULT_FILES = ["test_serialization.py", "test_flattened_resharding.py"]
# What Megatron-LM's test modules import beside megatron-core's own dependencies (its
# megatron/training package, the tests' utilities), and the test runner.
TEST_REQUIREMENTS = ["pytest==9.2.0", "pytest-timeout==2.4.0", "six", "regex", "einops", "pyyaml"]
TORCH_RELEASE, NUMPY_LINE = "2.15.0", "numpy2"


def log(message: str) -> None:
    print("[peer-tests] %s" % message, file=sys.stderr, flush=True)


def checkout_version(checkout: str) -> str:
    """megatron-core's version in the checkout (megatron/core/package_info.py)."""
    values = {}
    try:
        with open(os.path.join(checkout, "megatron", "core", "package_info.py")) as f:
            for line in f:
                match = re.match(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", line)
                if match:
                    values[match.group(1)] = match.group(2)
    except OSError:
        return "?"
    return ".".join(values.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))


def peer_venv() -> str:
    """A clone of the fresh torch 2.15.0 + numpy 2 venv with the wheel and the tests' needs."""
    spec = "%s|%s" % (envs.fresh_folder(TORCH_RELEASE, NUMPY_LINE), " ".join(TEST_REQUIREMENTS))
    python = envs.venv_python(PEER_VENV)
    wheel = envs.wheel(os.path.join(envs.CACHE, "peer-wheel"))
    if not envs._ready(PEER_VENV, spec):
        envs.fresh_venv(TORCH_RELEASE, NUMPY_LINE)
        log("creating %s (torch %s, numpy 2, pytest, Megatron-LM's test imports)" % (PEER_VENV, TORCH_RELEASE))
        envs.clone_venv(envs.fresh_folder(TORCH_RELEASE, NUMPY_LINE), PEER_VENV)
        envs.pip_install(python, *TEST_REQUIREMENTS)
        envs._stamp(PEER_VENV, spec)
    envs.pip_install(python, "--force-reinstall", "--no-deps", wheel)
    return python


def run_file(python: str, checkout: str, name: str, ranks: int, out: str, timeout: float) -> int:
    env = envs.child_env(
        PYTHONPATH=os.pathsep.join([checkout, PLUGIN_DIR]),
        PEER_TESTS_OUT=out,
    )
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        "pytest",
        "-p",
        "cpu_for_peer_tests",
        "-p",
        "no:cacheprovider",
        "-q",
        "--timeout",
        "900",
        os.path.join("tests", "unit_tests", "dist_checkpointing", name),
    ]
    started = time.time()
    with open(out + ".log", "w") as output:
        try:
            code = subprocess.run(
                command, cwd=checkout, env=env, stdout=output, stderr=output, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    log("%s: %d ranks, %.0f s (output in %s.log)" % (name, ranks, time.time() - started, out))
    return code


def merged(out: str) -> dict:
    """{test: (outcome, error)}: failed where any rank failed, else rank 0's outcome."""
    tests: dict = {}
    for path in sorted(glob.glob(os.path.join(out, "rank*.json"))):
        with open(path) as f:
            for nodeid, entry in json.load(f).items():
                current = tests.get(nodeid)
                if current is None or (entry["outcome"] == "failed" and current[0] != "failed"):
                    tests[nodeid] = (entry["outcome"], entry["error"])
    return tests


def why(error: str) -> str:
    """The reason a test failed here, in the words of the table."""
    missing = re.search(r"No module named '([\w.]+)'", error)
    if "strides" in error:
        return "ours: torch 2.15's TensorProperties.strides (tensor_properties_fields not active?)"
    if missing:
        return "an optional dependency is missing: %s" % missing.group(1).split(".")[0]
    if re.search(r"CUDA|cuda|NCCL|nccl|GPU", error):
        return "needs CUDA"
    return "its own: %s" % error


def main(argv: "list[str]") -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"), help="a Megatron-LM checkout")
    parser.add_argument("--file", action="append", help="a test file of tests/unit_tests/dist_checkpointing")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for each file's run")
    args = parser.parse_args(argv)
    checkout = args.megatron_lm
    if not checkout or not os.path.isdir(os.path.join(checkout, "tests", "unit_tests", "dist_checkpointing")):
        print(
            "peer-tests needs a Megatron-LM checkout (core_v0.12.1): MEGATRON_LM=/path/to/Megatron-LM make peer-tests; "
            "%r has no tests/unit_tests/dist_checkpointing" % checkout,
            file=sys.stderr,
        )
        return 2
    checkout = os.path.abspath(checkout)
    version = checkout_version(checkout)
    if version != "0.12.1":
        log("the checkout's megatron-core is %s (the table in docs/testing.md is for 0.12.1)" % version)
    python = peer_venv()
    rows = []
    for name in args.file or DEFAULT_FILES:
        out = os.path.join(envs.CACHE, "peer-out", name[: -len(".py")])
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        code = run_file(python, checkout, name, args.ranks, out, args.timeout)
        tests = merged(out)
        if not tests:
            rows.append((name, "error", "no results (exit %s): see %s.log" % (code, out)))
        for nodeid, (outcome, error) in sorted(tests.items()):
            rows.append((nodeid.split("::", 1)[1], outcome, "" if outcome == "passed" else why(error)))
    with open(RESULTS, "w") as f:
        json.dump({"megatron_core": version, "torch": TORCH_RELEASE, "rows": rows}, f, indent=1)
    print(
        "| test (megatron-core %s, torch %s, numpy 2, %d CPU ranks) | outcome | why |"
        % (version, TORCH_RELEASE, args.ranks)
    )
    print("|---|---|---|")
    for test, outcome, reason in rows:
        print("| `%s` | %s | %s |" % (test, outcome, reason.replace("|", "\\|")))
    counts = {o: sum(1 for _t, oo, _r in rows if oo == o) for o in ("passed", "failed", "skipped", "error")}
    log(", ".join("%d %s" % (n, o) for o, n in counts.items() if n))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
