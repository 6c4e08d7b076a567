"""Every way megatron-core's writer runs, end to end, with the wheel installed.

Each case runs examples/checkpoint_job.py in a subprocess of the e2e venv (torch 2.13.0, our
wheel from pip) with one megatron-core release on PYTHONPATH; the job never imports
mcore_autopatch. Covered: forked write workers at several thread counts, two gloo ranks,
megatron's own persistent (spawned) checkpoint worker, save functions run in spawn and
forkserver processes, and a torchrun-style single rank. Each fixed run is checked against
native megatron-core 0.13.1's bytes and against the same run with MCORE_AUTOPATCH=0.

megatron-core 0.9-0.11 call torch.distributed.get_rank() inside the write function, so their
save function can only run in a process that joined the process group: the spawn, forkserver
and persistent cases are for 0.12.x only (PersistentAsyncCaller exists from 0.12.0).
"""

import json
import socket
from typing import Any, Dict, List

import pytest
from conftest import JOB, REFERENCE, clean_env, compat_params, last_json, mcore_folder, run_python

pytestmark = pytest.mark.e2e

# 0.12.0, 0.12.1 and 0.12.2 ship the same checkpoint modules (tests/test_e2e_source_trees.py);
# 0.12.3's writer differs (its results-queue manager is started with spawn). One of each kind
# runs here, with and without the fix.
RELEASES_0_12 = ["0.12.1", "0.12.3"]
DISTINCT_0_12 = RELEASES_0_12
MISSING_FORMAT = "_write_item() missing 1 required positional argument: 'serialization_format'"
MISSING_TWO = "_write_item() missing 2 required positional arguments: 'storage_key' and 'serialization_format'"


def expected_error(version: str) -> str:
    return MISSING_FORMAT if version.startswith("0.12.") else MISSING_TWO


def assert_saved(result: Dict[str, Any]) -> None:
    """The fixed writer ran here: saved, loaded back equal, checkpoint complete."""
    assert result["ok"], result.get("traceback") or result
    assert result["write_item_replaced"] is True
    assert result["loaded_equal"] is True
    assert result["metadata_written"] is True


def assert_fails_unfixed(result: Dict[str, Any], version: str) -> None:
    """The bug as it shows without the fix: the worker's TypeError, no complete checkpoint."""
    assert not result["ok"]
    assert result["write_item_replaced"] is False
    assert result["error"].startswith("RuntimeError: Worker failure"), result["error"]
    assert expected_error(version) in result["error"]
    assert result["metadata_written"] is False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- forked write workers, several per rank ---------------------------------------------


@pytest.mark.parametrize("thread_count", [1, 4])
@pytest.mark.parametrize("version", compat_params(["0.9.0", "0.12.1"], "forked write workers, thread_count 1/4"))
def test_forked_write_workers_at_each_thread_count_write_native_bytes(
    run_job, reference_digests, version, thread_count
):
    """Each bucket goes to its own forked worker, which inherits the parent's rebinding.

    The rich state has eight write items, so N threads make exactly N buckets, i.e. N files.
    """
    result = run_job(version, "--state", "rich", "--thread-count", str(thread_count))
    assert_saved(result)
    assert result["mismatched"] == []
    assert sorted(result["files"]) == ["__0_%d.distcp" % i for i in range(thread_count)]
    assert result["files"] == reference_digests("rich", thread_count)


@pytest.mark.parametrize("version", ["0.9.0", "0.12.1"])
def test_forked_write_workers_fail_without_the_fix(run_job, version):
    result = run_job(version, "--state", "rich", "--thread-count", "4", env={"MCORE_AUTOPATCH": "0"})
    assert_fails_unfixed(result, version)


# --- two gloo ranks ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def two_rank_reference(e2e_python: str, tmp_path_factory: Any) -> Dict[int, Dict[str, str]]:
    """Per-rank ``.distcp`` digests native megatron-core 0.13.1 writes with two ranks."""
    folder = str(tmp_path_factory.mktemp("reference-two-ranks"))
    args = [JOB, "--json", "--no-load", "--dir", folder, "--state", "rich", "--launch", "2"]
    # MCORE_AUTOPATCH=0: the oracle is megatron-core's own writer, untouched.
    proc = run_python(e2e_python, args, clean_env(PYTHONPATH=mcore_folder(REFERENCE), MCORE_AUTOPATCH="0"))
    result = last_json(proc)
    assert result["ok"], result
    return {rank["rank"]: rank["files"] for rank in result["ranks"]}


@pytest.mark.parametrize("version", compat_params(["0.9.0", "0.12.1"], "two gloo ranks, sharded"))
def test_two_gloo_ranks_save_shards_byte_identical_to_native(run_job, two_rank_reference, version):
    """Two processes, torchrun-style env; rows sharded by rank, one view sharded along axis 1."""
    result = run_job(version, "--launch", "2", "--state", "rich")
    assert result["ok"], result
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert len({r["pid"] for r in ranks}) == 2  # each rank its own process
    for rank in ranks:
        assert_saved(rank)
        assert rank["files"], rank
        assert all(name.startswith("__%d_" % rank["rank"]) for name in rank["files"])
        assert rank["files"] == two_rank_reference[rank["rank"]]


def test_two_gloo_ranks_fail_without_the_fix(run_job):
    result = run_job("0.12.1", "--launch", "2", "--state", "rich", env={"MCORE_AUTOPATCH": "0"})
    assert not result["ok"]
    assert len(result["ranks"]) == 2
    for rank in result["ranks"]:
        assert_fails_unfixed(rank, "0.12.1")


# --- megatron's persistent checkpoint worker (spawned) ----------------------------------


@pytest.mark.parametrize("version", compat_params(RELEASES_0_12, "megatron's persistent (spawned) worker"))
def test_persistent_worker_saves_with_the_wheel(run_job, reference_digests, version):
    """PersistentAsyncCaller spawns a fresh interpreter that unpickles the request and imports
    megatron again; only the .pth fixes the writer there. The parent finalizes."""
    result = run_job(version, "--worker", "persistent")
    assert_saved(result)
    assert result["persistent_caller"] == "megatron"
    assert result["files"] == reference_digests("basic")


@pytest.mark.parametrize("version", RELEASES_0_12)
def test_persistent_worker_fails_without_the_fix(run_job, version):
    result = run_job(version, "--worker", "persistent", env={"MCORE_AUTOPATCH": "0"})
    assert_fails_unfixed(result, version)


# A parent that activates the fix in-process (install()) and then runs the unchanged job as
# __main__. Everything runs under the __main__ guard: spawned children import this file as
# __mp_main__ and must not install anything themselves. Before the job, a spawned probe
# reports what a spawned child sees (the persistent worker is started the same way).
DRIVER = '''
import json
import multiprocessing
import runpy
import sys


def probe(queue):
    """What a spawned child has: its flags, what it can import, whether our finder is active."""
    import importlib.util

    queue.put({
        "no_site": bool(sys.flags.no_site),
        "finds_megatron": importlib.util.find_spec("megatron.core") is not None,
        "finds_torch": importlib.util.find_spec("torch") is not None,
        "finds_mcore_autopatch": importlib.util.find_spec("mcore_autopatch") is not None,
        "finder_active": any(getattr(type(f), "_mcore_autopatch_finder", False) for f in sys.meta_path),
    })


if __name__ == "__main__":
    job, paths = sys.argv[1], sys.argv[2]
    sys.path[:0] = paths.split(":")
    import mcore_autopatch

    installed = mcore_autopatch.install()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=probe, args=(queue,))
    child.start()
    seen = queue.get(timeout=120)
    child.join()
    print("DRIVER " + json.dumps({"installed": installed, "spawned_child": seen}), file=sys.stderr, flush=True)
    sys.argv = [job] + sys.argv[3:]
    runpy.run_path(job, run_name="__main__")
'''


def run_install_driver(e2e_python: str, site_packages: str, tmp_path: Any, flags: List[str]) -> Dict[str, Any]:
    driver = tmp_path / "install_then_run_job.py"
    driver.write_text(DRIVER)
    paths = ":".join([mcore_folder("0.12.1"), site_packages])
    args = [*flags, str(driver), JOB, paths, "--json", "--dir", str(tmp_path / "ckpt"), "--worker", "persistent"]
    proc = run_python(e2e_python, args, clean_env())  # no PYTHONPATH: sys.path is set by hand
    result = last_json(proc)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("DRIVER ")]
    assert lines, proc.stderr[-4000:]
    result["driver"] = json.loads(lines[-1][len("DRIVER ") :])
    return result


def test_install_in_the_parent_only_does_not_reach_the_persistent_worker(e2e_python, e2e_site_packages, tmp_path):
    """Why the fix is a startup hook: under ``python -S`` no .pth runs; install() fixes the
    parent's writer, but the spawned worker (also started with -S) imports megatron afresh,
    unfixed, although it finds megatron, torch and mcore_autopatch on the inherited sys.path."""
    result = run_install_driver(e2e_python, e2e_site_packages, tmp_path, ["-S"])
    assert result["driver"] == {
        "installed": True,
        "spawned_child": {
            "no_site": True,
            "finds_megatron": True,
            "finds_torch": True,
            "finds_mcore_autopatch": True,
            "finder_active": False,
        },
    }
    assert result["write_item_replaced"] is True  # the parent's writer is fixed ...
    assert not result["ok"]  # ... yet the save made in the spawned worker fails
    assert result["error"].startswith("RuntimeError: Worker failure")
    assert MISSING_FORMAT in result["error"]
    assert result["metadata_written"] is False


def test_same_install_driver_with_the_startup_hook_saves_in_the_persistent_worker(
    e2e_python, e2e_site_packages, tmp_path
):
    """The same driver without -S: the .pth runs in the spawned worker too, and the save works."""
    result = run_install_driver(e2e_python, e2e_site_packages, tmp_path, [])
    assert result["driver"]["installed"] is True
    assert result["driver"]["spawned_child"]["no_site"] is False
    assert result["driver"]["spawned_child"]["finder_active"] is True
    assert_saved(result)
    assert result["persistent_caller"] == "megatron"


# --- the save function in a spawn or forkserver process ---------------------------------


@pytest.mark.parametrize("worker", ["spawn", "forkserver"])
@pytest.mark.parametrize("version", compat_params(RELEASES_0_12, "save function in spawn / forkserver processes"))
def test_save_function_in_a_fresh_interpreter_saves_with_the_wheel(run_job, reference_digests, version, worker):
    """spawn starts a new interpreter; forkserver forks from a server that is one. The .pth
    must act there, since the parent's rebinding does not travel."""
    result = run_job(version, "--worker", worker)
    assert_saved(result)
    assert result["worker_exitcode"] == 0
    assert result["files"] == reference_digests("basic")


@pytest.mark.parametrize("worker", ["spawn", "forkserver"])
@pytest.mark.parametrize("version", DISTINCT_0_12)
def test_save_function_in_a_fresh_interpreter_fails_without_the_fix(run_job, version, worker):
    result = run_job(version, "--worker", worker, env={"MCORE_AUTOPATCH": "0"})
    assert_fails_unfixed(result, version)


# --- torchrun-style environment, one rank ----------------------------------------------


def torchrun_env(**extra: str) -> Dict[str, str]:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    env.update(extra)
    return env


@pytest.mark.parametrize("version", compat_params(["0.9.0", "0.12.1"], "torchrun-style env"))
def test_torchrun_style_single_rank_saves_with_the_wheel(run_job, reference_digests, version):
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set: the job joins the group through env://."""
    result = run_job(version, env=torchrun_env())
    assert_saved(result)
    assert (result["rank"], result["world_size"]) == (0, 1)
    assert result["files"] == reference_digests("basic")


def test_torchrun_style_single_rank_fails_without_the_fix(run_job):
    result = run_job("0.12.1", env=torchrun_env(MCORE_AUTOPATCH="0"))
    assert_fails_unfixed(result, "0.12.1")


# The everyday tier runs each process kind once on 0.12.1; 0.9.0's, 0.12.3's, the second
# thread count and forkserver run in the matrix.
MATRIX_CELLS = {
    "test_forked_write_workers_at_each_thread_count_write_native_bytes[0.9.0-1]",
    "test_forked_write_workers_at_each_thread_count_write_native_bytes[0.9.0-4]",
    "test_forked_write_workers_at_each_thread_count_write_native_bytes[0.12.1-4]",
    "test_forked_write_workers_fail_without_the_fix[0.9.0]",
    "test_two_gloo_ranks_save_shards_byte_identical_to_native[0.9.0]",
    "test_persistent_worker_saves_with_the_wheel[0.12.3]",
    "test_persistent_worker_fails_without_the_fix[0.12.3]",
    "test_save_function_in_a_fresh_interpreter_saves_with_the_wheel[0.12.3-spawn]",
    "test_save_function_in_a_fresh_interpreter_saves_with_the_wheel[0.12.3-forkserver]",
    "test_save_function_in_a_fresh_interpreter_saves_with_the_wheel[0.12.1-forkserver]",
    "test_save_function_in_a_fresh_interpreter_fails_without_the_fix[0.12.3-spawn]",
    "test_save_function_in_a_fresh_interpreter_fails_without_the_fix[0.12.3-forkserver]",
    "test_save_function_in_a_fresh_interpreter_fails_without_the_fix[0.12.1-forkserver]",
    "test_torchrun_style_single_rank_saves_with_the_wheel[0.9.0]",
}
