"""Async saves finalized with their own write results (write_results_per_save, results_match_files).

tests/job_path/training_job.py ``save --scenario async-results`` makes six saves as
Megatron-LM's loop can make them, 2 gloo ranks, through ``AsyncCallsQueue`` with a finalize
that never waits (every training step): save 2 starts while save 1 is in flight (save 1's
write is made slow by the test, as a slow file system would make it: ``fsync`` of its files
waits for save 2's); save 4 is synchronous, made while save 3 is in flight (its own write
slow); save 5 is abandoned after its write (a new ``AsyncCallsQueue``, as an in-process
restart or an abort leaves it) and save 6 follows. The state has objects whose pickled size
changes from save to save (the rng state, a growing ``train_history``), as a job's has.
Every save reports success; ``resume --iteration all`` then loads every iteration into a
zeroed template and compares every value with what that iteration saved.

Without the fix (``MCORE_AUTOPATCH_SKIP`` names both rows; the other fixes stay, as numpy 2
needs them) iterations 1 - 4 and 6 fail to load: each was finalized with another save's
write results, as upstream does. With ``results_match_files`` alone, the first mixed-up
finalize stops with ``CheckpointingException`` instead of a checkpoint that reports success.
The jobs never import mcore_autopatch.
"""

import json
import os
from typing import Any, Dict, List

import pytest
from conftest import (
    CPU_TORCH,
    clean_env,
    compat_params,
    fresh_key,
    job_failure,
    mcore_folder,
    run_dir_folder,
    run_python,
    run_training_job,
)

pytestmark = pytest.mark.e2e

# Save 1's write ends after save 2's, save 4's after save 3's: each file's fsync waits for the
# other save's file of the same name (then two seconds), so the order holds on a loaded machine. The persistent worker
# writes one save after the other, so there save 1 is only slower.
SCENARIO = ["--scenario", "async-results", "--growing-object"]
SLOW = {"temporal": "1:after=2,4:after=3", "persistent": "1:2.5,4:after=3"}
BOTH = "write_results_per_save,results_match_files"
EVERYDAY = fresh_key(CPU_TORCH, "numpy2")  # torch 2.13.0 (the CPU wheel) and numpy 2
# What each release's job saves: 0.8 - 0.10 keep a 1-D weight's optimizer state in one rank's
# piece (tests/test_e2e_fresh_stack.py); 0.16 no longer saves flattened tensors (model state).
RELEASE_ARGS: Dict[str, List[str]] = {
    "0.8.0": ["--whole-1d"],
    "0.9.0": ["--whole-1d"],
    "0.10.0": ["--whole-1d"],
    "0.16.1": ["--state", "model"],
}
RELEASES = ["0.8.0", "0.9.0", "0.10.0", "0.11.0", "0.12.0", "0.12.1", "0.12.2", "0.12.3"]
RELEASES += ["0.13.0", "0.13.1", "0.14.0", "0.15.3", "0.16.1"]
# 0.14 and 0.15 compile a CUDA extension at import on a CUDA build of torch without a GPU
# (tests/test_e2e_fresh_stack.py): they run on the CPU wheel.
CPU_ONLY = {"0.14.0", "0.15.3"}
SAVED = [1, 2, 3, 4, 6]  # 5 was abandoned: it has no .metadata
BROKEN_WITHOUT = {"temporal": [1, 2, 3, 4, 6], "persistent": [3, 4, 6]}  # persistent writes run in order
# What reading a checkpoint finalized with another save's results raises, inside torch's
# CheckpointException (which of them depends on where the other save's offsets fall).
DAMAGED_READS = (
    "PytorchStreamReader failed reading zip archive",
    "Weights only load failed",
    "invalid load key",
    "negative seek value",
    "unsupported persistent id",
)
OWN = "async saves (overlapping, sync during async, abandoned): each loads its own state"
OWN_OFF = "async saves without write_results_per_save: report success, cannot be loaded"


def scenario(python: str, version: str, *extra: str, env: "Dict[str, str] | None" = None) -> Dict[str, Any]:
    """The save job, then every iteration loaded and compared; both results, and the folder."""
    args = [*RELEASE_ARGS.get(version, []), *extra]
    slow = SLOW["persistent" if "--persistent" in extra else "temporal"]
    root = run_dir_folder("async-%s-" % version)
    save = run_training_job(python, version, "save", root, *SCENARIO, "--slow-write", slow, *args, env=env)
    load = run_training_job(python, version, "resume", root, "--iteration", "all", "--growing-object", *args, env=env)
    return {"save": save, "load": load, "root": root}


def iterations(load: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    ranks = load.get("ranks") or [{}]
    return {int(k): v for k, v in (ranks[0].get("iterations") or {}).items()}


def loads_equal(result: Dict[str, Any]) -> List[int]:
    return sorted(i for i, e in iterations(result["load"]).items() if e.get("loaded_equal"))


def assert_each_loads_its_own(result: Dict[str, Any]) -> None:
    assert result["save"]["ok"], job_failure(result["save"])
    found = iterations(result["load"])
    assert sorted(found) == [1, 2, 3, 4, 5, 6], job_failure(result["load"])
    assert found[5] == {"metadata": False}  # abandoned before its finalize: never written
    assert loads_equal(result) == SAVED, {i: e.get("error", "")[-300:] for i, e in found.items()}


def assert_reported_success_and_cannot_be_loaded(result: Dict[str, Any], broken: List[int]) -> None:
    assert result["save"]["ok"], job_failure(result["save"])  # every save said it succeeded
    found = iterations(result["load"])
    assert sorted(i for i in SAVED if not found[i].get("loaded_equal")) == broken, found
    for i in broken:  # torch's CheckpointException, from reading bytes at another save's offsets
        assert found[i]["error"].startswith("CheckpointException"), found[i]
        assert any(text in found[i]["error"] for text in DAMAGED_READS), found[i]["error"]


# --- the everyday tier: megatron-core 0.12.1 on torch 2.13.0 and numpy 2 ----------------------------


@pytest.mark.parametrize("version", compat_params(["0.12.1"], OWN))
@pytest.mark.parametrize("caller", ["temporal", "persistent"])
def test_async_saves_each_load_back_their_own_state_with_the_wheel(torch_python, version, caller):
    extra = ["--persistent"] if caller == "persistent" else []
    python = torch_python(EVERYDAY)
    result = scenario(python, version, *extra)
    assert_each_loads_its_own(result)
    # inspect passes what the fixed job saved (test_inspect_names_a_checkpoint_... names the damaged)
    env = clean_env(PYTHONPATH=mcore_folder(version))
    fine = run_python(python, ["-m", "mcore_autopatch", "inspect", os.path.join(result["root"], "iter_0000001")], env)
    assert fine.returncode == 0, fine.stdout + fine.stderr
    assert "each ends where its last item ends" in fine.stdout


@pytest.mark.parametrize("version", compat_params(["0.12.1"], OWN_OFF))
@pytest.mark.parametrize("caller", ["temporal", "persistent"])
def test_without_the_fix_async_saves_report_success_and_cannot_be_loaded(torch_python, version, caller):
    extra = ["--persistent"] if caller == "persistent" else []
    result = scenario(torch_python(EVERYDAY), version, *extra, env={"MCORE_AUTOPATCH_SKIP": BOTH})
    assert_reported_success_and_cannot_be_loaded(result, BROKEN_WITHOUT[caller])


def test_results_match_files_alone_stops_the_mixed_up_finalize_before_metadata(torch_python):
    """write_results_per_save skipped: save 1 is given save 2's results; each rank checks its own
    files, the verdict travels with the gather of write results megatron-core already makes, and
    the coordinator raises torch's CheckpointException naming the rank and megatron-core's
    CheckpointingException; no .metadata is written."""
    result = scenario(torch_python(EVERYDAY), "0.12.1", env={"MCORE_AUTOPATCH_SKIP": "write_results_per_save"})
    error = result["save"]["ranks"][0]["error"] or ""
    assert error.startswith("CheckpointException: CheckpointException ranks:dict_keys(["), job_failure(result["save"])
    assert "CheckpointingException: mcore-autopatch: the write results this save was given do not match" in error
    assert "iter_0000001: __" in error
    assert "bytes past the end" in error or "bytes that no item covers" in error
    assert "resume from another iteration" in error
    assert iterations(result["load"])[1] == {"metadata": False}


def test_after_an_abort_shut_the_results_manager_down_the_next_save_gets_a_new_one(torch_python):
    """The abort shuts the manager of megatron-core's results queue down and leaves the dead
    queue in place; without the fix the next save fails on it (loudly, at least)."""
    result = scenario(torch_python(EVERYDAY), "0.12.1", "--abandon", "shut-down-manager")
    assert_each_loads_its_own(result)
    off = scenario(
        torch_python(EVERYDAY), "0.12.1", "--abandon", "shut-down-manager", env={"MCORE_AUTOPATCH_SKIP": BOTH}
    )
    assert not off["save"]["ok"]
    # The save's process cannot put its results on the dead manager's queue: megatron-core's own
    # error (Broken pipe, Connection refused), or, where failed_saves_raise_everywhere fails that
    # save on every rank, the process's exit code.
    error = off["save"]["error"]
    assert "Broken pipe" in error or "Connection" in error or "exited with code 1" in error, error


def test_inspect_names_a_checkpoint_finalized_with_another_saves_results(torch_python, python_without_wheel):
    """Made for real without the package (megatron-core 0.13.1, which needs nothing else on
    torch 2.13.0 and numpy 1.26), then inspected with it: the damaged iteration is named, with
    the way out, and exit 1 (what the fixed job saved passes: the test above)."""
    off = scenario(python_without_wheel(CPU_TORCH), "0.13.1")
    assert_reported_success_and_cannot_be_loaded(off, BROKEN_WITHOUT["temporal"])
    python = torch_python(CPU_TORCH)
    env = clean_env(PYTHONPATH=mcore_folder("0.13.1"))
    damaged = run_python(python, ["-m", "mcore_autopatch", "inspect", os.path.join(off["root"], "iter_0000001")], env)
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    line = next(ln for ln in damaged.stdout.splitlines() if ln.strip().startswith("loads here:"))
    assert "no: its .metadata does not match its files" in line
    assert "finalized with another save's write results" in line and line.endswith("resume from another iteration")
    report = run_python(python, ["-m", "mcore_autopatch", "inspect", "--json", off["root"] + "/iter_0000001"], env)
    assert json.loads(report.stdout)["storage"]["mismatched"], report.stdout


# --- the matrix: every release from 0.8.0, on torch 2.9.0 and the newest ----------------------------------

# The code the rows read and rebind (_get_write_results_queue, the queue prepare_write_data
# takes, retrieve_write_results), grouped where it is the same text in every release of a
# group (test_the_queue_code_is_the_same_within_each_group): one of each group runs with the
# fix on the newest torch and on torch 2.9.0, and without the fix (every release makes async
# saves and resumes them on the newest torch in tests/test_e2e_fresh_stack.py).
QUEUE_CODE_GROUPS = [
    ["0.8.0", "0.9.0", "0.10.0", "0.11.0"],
    ["0.12.0", "0.12.1", "0.12.2"],
    ["0.12.3"],
    ["0.13.0", "0.13.1"],
    ["0.14.0", "0.15.3", "0.16.1"],
]
# (0.16.1 beside 0.14.0: the same queue code, another async caller.)
ONE_OF_EACH_GROUP = ["0.8.0", "0.12.0", "0.12.3", "0.13.1", "0.14.0", "0.16.1"]


def queue_code(version: str) -> str:
    """The queue's code of one release, as text without comments, docstrings and line numbers."""
    import ast

    path = os.path.join(mcore_folder(version), "megatron/core/dist_checkpointing/strategies/filesystem_async.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in ("_get_write_results_queue", "retrieve_write_results"):
            body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
            parts.append(ast.dump(ast.Module(body=body, type_ignores=[])))
        if isinstance(node, ast.FunctionDef) and node.name == "prepare_write_data":
            parts += [
                ast.dump(n) for n in ast.walk(node) if isinstance(n, ast.Assign) and "results_queue" in ast.dump(n)
            ]
    return "\n".join(parts)


def test_the_queue_code_is_the_same_within_each_group():
    for group in QUEUE_CODE_GROUPS:
        assert len({queue_code(v) for v in group}) == 1, group
    assert len({queue_code(group[0]) for group in QUEUE_CODE_GROUPS}) == len(QUEUE_CODE_GROUPS)
    assert sorted(v for group in QUEUE_CODE_GROUPS for v in group) == sorted(RELEASES)
    assert all(any(v in group for v in ONE_OF_EACH_GROUP) for group in QUEUE_CODE_GROUPS)


def sweep(what: str, torches: List[str], releases: List[str]) -> List[Any]:
    cells = []
    for version in releases:
        for torch in [fresh_key(CPU_TORCH, "numpy2")] if version in CPU_ONLY else torches:
            mark = [pytest.mark.compat(version, what), pytest.mark.matrix]
            cells.append(pytest.param(version, torch, marks=mark, id="%s-%s" % (version, torch)))
    return cells


NEWEST = fresh_key("2.15.0", "numpy2")
FIRST_TO_DROP_MCORE_DATA = fresh_key("2.9.0", "numpy2")  # where every other fix applies too
OWN_CELLS = sweep(OWN, [NEWEST], ONE_OF_EACH_GROUP) + [
    p for p in sweep(OWN, [FIRST_TO_DROP_MCORE_DATA], ONE_OF_EACH_GROUP) if p.values[0] not in CPU_ONLY
]


@pytest.mark.parametrize("version,torch_release", OWN_CELLS)
def test_every_release_saves_async_each_with_its_own_results(torch_python, version, torch_release):
    assert_each_loads_its_own(scenario(torch_python(torch_release), version))


@pytest.mark.parametrize("version,torch_release", sweep(OWN_OFF, [NEWEST], ONE_OF_EACH_GROUP))
def test_every_release_without_the_fix_reports_success_and_cannot_be_loaded(torch_python, version, torch_release):
    result = scenario(torch_python(torch_release), version, env={"MCORE_AUTOPATCH_SKIP": BOTH})
    assert_reported_success_and_cannot_be_loaded(result, BROKEN_WITHOUT["temporal"])
