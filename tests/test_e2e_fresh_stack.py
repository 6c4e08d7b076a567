"""The stack a fresh image has around megatron-core, for every release: a training job's checkpoint
path saved and resumed on numpy 2 and numpy 1.26, with setuptools >= 82 (no pkg_resources).

Each cell is one megatron-core release (its registry files on PYTHONPATH) in a fresh venv
(``envs.fresh_venv``: torch 2.9.0 or 2.15.0, the registry's newest, or 2.13.0 for 0.14/0.15,
which on a CUDA build of torch without a GPU compile a CUDA extension at import; the newest
numpy 2 or numpy 1.26.4; the newest setuptools). tests/job_path/training_job.py runs the path
that release's Megatron-LM ran: 2 gloo ranks, model state with the ``rng_state``
ShardedObject (numpy's generator state inside) and ``args`` as an ``argparse.Namespace`` in
the common state, the distributed optimizer's state (``fully_sharded_bucket_space`` on 0.6
and 0.7, ``fully_sharded_model_space`` from 0.8), 2 saves (fully parallel and async from 0.7),
then a fresh job that resumes with both data-parallel ranks (fully parallel load from 0.8) and
compares every value, Namespace args and generator states included. The jobs never import
mcore_autopatch.

Without the package each cell fails the way upstream fails: numpy 2 at the first save
(``np.product``; the other rank loses its peer), 0.7/0.8 at ``import megatron.core``
(``pkg_resources``), 0.6/0.9/0.10 at the resume (``weights_only``), 0.6 - 0.8 at the plan of
a ShardedObject on torch 2.4+, and the ``_write_item`` of 0.6 - 0.12 on torch 2.8+.
"""

import json
import os
from typing import Any, Dict, List

import pytest
from conftest import (
    PY312,
    clean_env,
    envs,
    fresh_key,
    job_failure,
    mcore_folder,
    run_dir_folder,
    run_python,
    run_training_job,
)
from test_e2e_job_path import copy_of, saved
from test_e2e_save import release

pytestmark = pytest.mark.e2e

# What each release's Megatron-LM ran (see training_job.py): the optimizer layout, and where
# 0.8 - 0.10 keep a 1-D weight's state in one rank's piece (they refuse one split among ranks
# on every torch, torch 2.3.1 of their time included: docs/compatibility.md).
# Two saves each (the second reuses the cached structure where the release has it); reusing
# the loaded metadata on the save after a resume is shown by tests/test_e2e_job_path.py.
FRESH = ["--iterations", "2"]
ROW_ARGS: Dict[str, List[str]] = {
    version: [*FRESH, *args]
    for version, args in {
        "0.6.0": ["--optimizer-layout", "bucket"],
        "0.7.0": ["--optimizer-layout", "bucket", "--plain-load"],
        "0.8.0": ["--whole-1d"],
        "0.9.0": ["--whole-1d"],
        "0.10.0": ["--whole-1d"],
        "0.11.0": [],
        "0.12.0": [],
        "0.12.1": [],
        "0.12.2": [],
        "0.12.3": [],
        "0.13.0": [],
        "0.13.1": [],
        "0.14.0": [],
        "0.15.3": [],
        "0.16.1": ["--state", "model"],  # 0.16 saves no flattened tensors
    }.items()
}
# Every resume also describes the checkpoint without loading it and loads it strictly (Megatron-LM's
# --dist-ckpt-strictness raise_all, 0.8+): on torch 2.15 both build meta tensors from
# TensorProperties, which gained strides (tensor_properties_fields).
READS = ["--read-metadata"]
STRICT = ["--strict", "raise_all"]
FRESH_JOB = "job path on a fresh stack: saves, resumes equal (Namespace args, rng_state)"
FRESH_OFF = "job path on a fresh stack, without the package: fails as upstream fails"


# The seed report's release: both numpys on both torches (numpy 1.26 on 2.9.0 is its job cell
# of tests/test_e2e_job_path.py, in torch 2.9.0's own venv).
EVERY_PAIR = {"0.12.1"}


# torch 2.9.0 adds a cell only for the rows that save mcore_data (0.8 - 0.14), which torch 2.9 -
# 2.11 drop (keep_mcore_data, load_without_mcore_data): every other fix a row needs on 2.9.0 it
# needs on 2.15.0 too, which adds tensor_properties_fields.
def saves_mcore_data(version: str) -> bool:
    return (0, 8) <= release(version) < (0, 15)


def cells_of(version: str) -> List[str]:
    """Each row runs with numpy 2 (what a fresh image has) on the registry's newest torch, 2.15.0,
    and, where it saves mcore_data, on torch 2.9.0, where every fix applies at once; the seed
    report's release also with numpy 1.26 on 2.15.0 (numpy 1.26's own rows are the torch venvs'
    job paths, tests/test_e2e_job_path.py)."""
    cells = [fresh_key("2.9.0", "numpy2")] if saves_mcore_data(version) else []
    cells.append(fresh_key("2.15.0", "numpy2"))
    return [*cells, fresh_key("2.15.0", "numpy1")] if version in EVERY_PAIR else cells


def resume_args(version: str) -> List[str]:
    return READS + (STRICT if release(version) >= (0, 8) else [])  # 0.6 / 0.7 have no strictness


CELLS = [
    pytest.param(v, cell, marks=pytest.mark.compat(v, FRESH_JOB), id="%s-%s" % (v, cell))
    for v in ROW_ARGS
    for cell in cells_of(v)
]

PRODUCT = "AttributeError: module 'numpy' has no attribute 'product'"
NO_PKG_RESOURCES = "ModuleNotFoundError: No module named 'pkg_resources'"
WEIGHTS_ONLY = "Weights only load failed"
PLANNED_TWICE = "item.index.fqn not in md"


def assert_saved_and_resumed(
    python: Any, cell: str, version: str, *args: str, pkg_resources: str = "missing"
) -> Dict[str, Any]:
    """The job's saves (once per run and cell), then a fresh 2-rank resume that saves again."""
    save = saved(python, cell, version, *args)
    assert save["ok"], job_failure(save)
    ranks = save["ranks"]
    assert all(r["saved"] == [1, 2] for r in ranks)
    line = "numpy2" if cell == PY312 else cell.rpartition("-")[2]
    assert all(r["numpy"].startswith("2.") if line == "numpy2" else r["numpy"] == "1.26.4" for r in ranks)
    assert all(r["cached_structure_reused"] in (True, None) for r in ranks)  # None: 0.6 / 0.7 have none
    assert all(stack_untouched(r, version, pkg_resources) for r in ranks), [r.get("stack") for r in ranks]
    resume = run_training_job(python(cell), version, "resume", copy_of(save["root"]), *args, *resume_args(version))
    assert resume["ok"], job_failure(resume)
    assert [r["iteration"] for r in resume["ranks"]] == [2, 2]
    assert all(r["loaded_equal"] and r["common_args"] for r in resume["ranks"])
    assert all(set(r["metadata_reads"].values()) == {True} for r in resume["ranks"]), resume["ranks"][0]
    assert all(stack_untouched(r, version, pkg_resources) for r in resume["ranks"])
    return save


def stack_untouched(rank: Dict[str, Any], version: str, pkg_resources: str) -> bool:
    """In the very process that saved or resumed: numpy has no ``product`` (numpy 2), torch.load
    of a Namespace pickle outside megatron-core is refused (torch >= 2.6; megatron-core 0.14+
    allow Namespace for the whole process themselves, at import), pkg_resources cannot be
    imported where setuptools has none, and nothing of megatron-core's is left in it."""
    stack = rank["stack"]
    return (
        stack["numpy_has_product"] is not rank["numpy"].startswith("2.")
        and stack["torch_load_refuses_namespace"] is (release(version) < (0, 14))
        and stack["pkg_resources"] == pkg_resources
        and stack["pkg_resources_packaging_module"] is False
    )


@pytest.mark.parametrize("version,torch_release", CELLS)
def test_job_saves_and_resumes_on_a_fresh_stack_with_the_wheel(torch_python, version, torch_release):
    assert_saved_and_resumed(torch_python, torch_release, version, *ROW_ARGS[version])


# --- without the package ------------------------------------------------------------------------------


def first_failure_on_numpy_2(version: str) -> str:
    return NO_PKG_RESOURCES if version in ("0.7.0", "0.8.0") else PRODUCT


OFF_NUMPY2 = [  # 0.16 no longer calls what numpy 2 removed
    pytest.param(v, fresh_key("2.9.0", "numpy2"), marks=pytest.mark.compat(v, FRESH_OFF), id=v)
    for v in ROW_ARGS
    if release(v) < (0, 16)
]


@pytest.mark.parametrize("version,torch_release", OFF_NUMPY2)
def test_without_the_package_numpy_2_fails_the_first_save_as_upstream_does(
    python_without_wheel, version, torch_release
):
    """Rank 0 raises in megatron-core's own validation (or at import, 0.7/0.8); the other rank
    loses its peer in the next collective instead of waiting 30 minutes (--pg-timeout)."""
    root = run_dir_folder("off-numpy2-")
    result = run_training_job(python_without_wheel(torch_release), version, "save", root, *ROW_ARGS[version])
    assert not result["ok"]
    assert result["ranks"][0]["error"].startswith(first_failure_on_numpy_2(version)), result["ranks"][0]["error"]
    assert not os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt"))


WEIGHTS_ONLY_ROWS = {"0.6.0": "2.15.0-numpy1", "0.9.0": "2.15.0-numpy1", "0.10.0": "2.15.0-numpy1"}


@pytest.mark.parametrize(
    "version,torch_release",
    [pytest.param(v, c, marks=pytest.mark.compat(v, FRESH_OFF), id=v) for v, c in WEIGHTS_ONLY_ROWS.items()],
)
def test_without_the_package_resuming_fails_on_torchs_weights_only_default(
    torch_python, python_without_wheel, version, torch_release
):
    """Saved with the wheel, resumed in the same image without it: megatron-core's bare
    torch.load of common.pt refuses Megatron-LM's Namespace args."""
    cell = torch_release
    save = saved(torch_python, cell, version, *ROW_ARGS[version])
    assert save["ok"], job_failure(save)
    result = run_training_job(python_without_wheel(cell), version, "resume", save["root"], *ROW_ARGS[version])
    assert not result["ok"]
    error = result["ranks"][0]["error"]
    assert WEIGHTS_ONLY in error and "argparse.Namespace" in error, error


@pytest.mark.parametrize(
    "version,torch_release",
    [pytest.param(v, "2.9.0", marks=pytest.mark.compat(v, FRESH_JOB), id=v) for v in ("0.7.0", "0.8.0")],
)
def test_old_image_with_pkg_resources_resumes_only_with_the_package(
    torch_python, python_without_wheel, version, torch_release
):
    """torch 2.9.0's own venv has setuptools 65 (pkg_resources with packaging) and numpy 1.26:
    0.7/0.8 import there without help, and their resume still needs the weights_only fix."""
    save = saved(torch_python, "2.9.0-numpy1", version, *ROW_ARGS[version])
    assert save["ok"], job_failure(save)
    off = run_training_job(python_without_wheel("2.9.0"), version, "resume", save["root"], *ROW_ARGS[version])
    assert not off["ok"]
    assert WEIGHTS_ONLY in off["ranks"][0]["error"], off["ranks"][0]["error"]
    fixed = run_training_job(torch_python("2.9.0"), version, "resume", copy_of(save["root"]), *ROW_ARGS[version])
    assert fixed["ok"], job_failure(fixed)
    assert all(r["stack"]["pkg_resources"] == "importable" for r in fixed["ranks"])


@pytest.mark.parametrize(
    "version,torch_release",
    [pytest.param(v, "2.6.0", marks=pytest.mark.compat(v, FRESH_JOB), id=v) for v in ("0.6.0", "0.7.0", "0.8.0")],
)
def test_sharded_objects_planned_twice_on_torch_2_6_without_the_package(torch_python, version, torch_release):
    """torch 2.6.0, where 0.6 - 0.8 call _write_item as it wants and pkg_resources is there:
    the only break left for a save is the ShardedObject (rng_state) planned twice."""
    root = run_dir_folder("off-planner-")
    off = run_training_job(
        torch_python("2.6.0"), version, "save", root, *ROW_ARGS[version], env={"MCORE_AUTOPATCH": "0"}
    )
    assert not off["ok"]
    assert PLANNED_TWICE in off["ranks"][0]["error"] or PLANNED_TWICE in (off["ranks"][0].get("traceback") or "")
    assert_saved_and_resumed(torch_python, "2.6.0", version, *ROW_ARGS[version], pkg_resources="importable")


# --- torch 2.15: TensorProperties.strides ----------------------------------------------------------------

STRIDES = "TypeError: empty() got an unexpected keyword argument 'strides'"
OLDER_TORCH_READING_2_15 = "too many values to unpack (expected 5)"
# The oldest, the first with load_sharded_metadata and strict loads (0.8), the seed report's
# release and the newest: every row's resume with the fix is the cell above.
STRIDES_ROWS = ["0.6.0", "0.8.0", "0.12.1", "0.16.1"]
STRIDES_OFF = "describe and strict-load on torch 2.15 without tensor_properties_fields: the strides TypeError"


@pytest.mark.parametrize(
    "version,torch_release",
    [pytest.param(v, "2.15.0-numpy2", marks=pytest.mark.compat(v, STRIDES_OFF), id=v) for v in STRIDES_ROWS],
)
def test_without_the_strides_row_reading_a_checkpoints_metadata_fails_on_torch_2_15(
    torch_python, version, torch_release
):
    """The job's checkpoint (saved in this run by the cell above), resumed with the row skipped:
    load_tensors_metadata and load_sharded_metadata raise, and so does a raise_all load."""
    args = ROW_ARGS[version]
    save = saved(torch_python, torch_release, version, *args)
    assert save["ok"], job_failure(save)
    env = {"MCORE_AUTOPATCH_SKIP": "tensor_properties_fields"}
    off = run_training_job(
        torch_python(torch_release), version, "resume", copy_of(save["root"]), *args, *resume_args(version), env=env
    )
    assert not off["ok"]
    rank = off["ranks"][0]
    reads = rank.get("metadata_reads") or {}
    assert STRIDES in (rank.get("error") or "") or any(STRIDES in str(v) for v in reads.values()), rank


@pytest.mark.matrix
def test_a_checkpoint_saved_on_torch_2_15_cannot_be_read_by_torch_2_14_or_earlier(torch_python):
    """torch 2.15 pickles six TensorProperties fields; torch <= 2.14 unpickles exactly five. Nothing
    of ours is in the file (the same holds without the package); inspect says what to do."""
    args = ROW_ARGS["0.12.1"]
    save = saved(torch_python, "2.15.0-numpy2", "0.12.1", *args)
    assert save["ok"], job_failure(save)
    older = torch_python("2.13.0-numpy2")
    resume = run_training_job(older, "0.12.1", "resume", copy_of(save["root"]), *args)
    assert not resume["ok"]
    assert OLDER_TORCH_READING_2_15 in resume["ranks"][0]["error"], resume["ranks"][0]["error"]
    folder = os.path.join(save["root"], "iter_0000002")
    inspect = run_python(
        older, ["-m", "mcore_autopatch", "inspect", folder], clean_env(PYTHONPATH=mcore_folder("0.12.1"))
    )
    assert inspect.returncode == 2
    assert "written by torch 2.15 or later" in inspect.stderr and "with torch 2.15 or later" in inspect.stderr


# --- more of what a fresh image meets -------------------------------------------------------------------


@pytest.mark.matrix
def test_checkpoint_saved_on_numpy_1_resumes_after_the_image_moves_to_numpy_2(torch_python):
    """An image upgraded from numpy 1.26 to numpy 2 resumes what it saved before."""
    args = ROW_ARGS["0.12.1"]
    save = saved(torch_python, "2.15.0-numpy1", "0.12.1", *args)
    assert save["ok"], job_failure(save)
    resume = run_training_job(torch_python("2.15.0-numpy2"), "0.12.1", "resume", copy_of(save["root"]), *args)
    assert resume["ok"], job_failure(resume)
    assert all(r["loaded_equal"] and r["numpy"].startswith("2.") for r in resume["ranks"])


@pytest.mark.parametrize(
    "version,torch_release", [pytest.param("0.12.1", PY312, marks=pytest.mark.compat("0.12.1", FRESH_JOB), id="0.12.1")]
)
def test_python_3_12_runs_the_release_files_and_saves_and_resumes(
    torch_python, python_without_wheel, version, torch_release
):
    """vLLM images' CPython 3.12: megatron-core 0.12.1 has no wheel for it and runs from the
    release's files on PYTHONPATH; torch 2.9.0 and numpy 2, so every fix applies at once."""
    save = assert_saved_and_resumed(torch_python, PY312, version, *ROW_ARGS[version])
    assert save["ranks"][0]["python"].startswith("3.12.")
    root = run_dir_folder("off-py312-")
    off = run_training_job(python_without_wheel(PY312), version, "save", root, *ROW_ARGS[version])
    assert not off["ok"] and off["ranks"][0]["error"].startswith(PRODUCT)


@pytest.mark.matrix
def test_setuptools_70_3_pkg_resources_without_packaging(torch_python, python_without_wheel):
    """setuptools 70.0 - 70.3 have a pkg_resources without ``packaging``: 0.8's imports get it
    for their own import only; the real pkg_resources stays as it is, in the same process."""
    version, cell = "0.8.0", "2.13.0-numpy1"
    path = os.pathsep.join([envs.setuptools_folder(), mcore_folder(version)])
    root = run_dir_folder("setuptools-70-")
    job = run_training_job(torch_python(cell), version, "save", root, "--whole-1d", "--iterations", "1", path=path)
    assert job["ok"], job_failure(job)
    stacks = [r["stack"] for r in job["ranks"]]
    assert all(s["pkg_resources"] == "importable" and s["pkg_resources_has_packaging"] is False for s in stacks)
    assert all(s["pkg_resources_packaging_module"] is False for s in stacks)
    status = run_python(torch_python(cell), ["-m", "mcore_autopatch", "status", "--json"], clean_env(PYTHONPATH=path))
    row = next(f for f in json.loads(status.stdout)["fixes"] if f["fix"] == "pkg_resources_packaging")
    assert (row["needed"], row["applied"]) == (True, True), row
    assert "pkg_resources has no packaging (setuptools 70.0 - 70.3)" in row["reason"]
    off = run_python(python_without_wheel(cell), ["-c", "import megatron.core"], clean_env(PYTHONPATH=path))
    assert "ImportError: cannot import name 'packaging' from 'pkg_resources'" in off.stderr


def test_skipping_a_fix_leaves_it_out_and_check_says_so(torch_python):
    """MCORE_AUTOPATCH_SKIP=numpy_removed_names on numpy 2: the fix is read and reported, not
    applied; `check` names it skipped and passes (a choice, not a broken image); the selftest's
    distributed-optimizer-style save then fails as upstream does."""
    python = torch_python("2.13.0-numpy2")
    env = clean_env(PYTHONPATH=mcore_folder("0.12.1"), MCORE_AUTOPATCH_SKIP="numpy_removed_names")
    check = run_python(python, ["-m", "mcore_autopatch", "check"], env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "megatron-core numpy_removed_names skipped (megatron-core 0.12.1 calls numpy.product" in check.stdout
    assert "skipped: MCORE_AUTOPATCH_SKIP names it" in check.stdout
    selftest = run_python(python, ["-m", "mcore_autopatch", "selftest"], env)
    assert selftest.returncode == 1
    assert selftest.stdout.startswith("selftest: FAILED: distributed-optimizer-style state: the save raised " + PRODUCT)


# --- the everyday tier: the rows on numpy 2, on the CPU wheel --------------------------------------------

# One row for each set of fixes a release needs here (write_item's two call shapes, numpy's
# removed names, weights_only for 0.6 - 0.10 and 0.14+, pkg_resources for 0.7 / 0.8, the
# ShardedObject planned twice for 0.6 - 0.8, none of numpy's from 0.16); the releases between
# them save and resume on numpy 2 with two ranks in the matrix (torch 2.15.0).
ONE_RANK_RELEASES = ["0.6.0", "0.7.0", "0.8.0", "0.10.0", "0.11.0", "0.12.1", "0.13.1", "0.14.0", "0.16.1"]
ONE_RANK_ROWS = {v: ROW_ARGS[v] for v in ONE_RANK_RELEASES}
NUMPY2_ROW = "save and resume on numpy 2, setuptools 82+ (one rank)"


@pytest.mark.parametrize(
    "version,torch_release",
    [
        pytest.param(v, fresh_key("2.13.0", "numpy2"), marks=pytest.mark.compat(v, NUMPY2_ROW), id=v)
        for v in ONE_RANK_ROWS
    ],
)
def test_every_row_saves_and_resumes_on_numpy_2_with_the_wheel(torch_python, version, torch_release):
    """What a fresh image has: a one-rank job saves and resumes equal."""
    python = torch_python(torch_release)
    args = ONE_RANK_ROWS[version]
    root = run_dir_folder("numpy2-row-")
    save = run_training_job(python, version, "save", root, *args, ranks=1)
    assert save["ok"], job_failure(save)
    assert save["ranks"][0]["numpy"].startswith("2.")
    resume = run_training_job(python, version, "resume", root, *args, ranks=1)
    assert resume["ok"], job_failure(resume)
    assert resume["ranks"][0]["loaded_equal"]
