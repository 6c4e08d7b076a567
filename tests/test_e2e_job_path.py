"""A training job's checkpoint path, saved and resumed for real, on every torch release.

``tests/job_path/training_job.py`` does what Megatron-LM's ``megatron/training/checkpointing.py``
(core_r0.12.1) does with real megatron-core APIs: 2 gloo ranks; model-style state (a tensor
sharded across the ranks, layer-stacked and 1-D weights replicated across data-parallel
ranks, a ShardedObject, common state) and the distributed optimizer's
``fully_sharded_model_space`` state (N-D flattened tensors); the default torch_dist strategy
with the cached structure inside ``FullyParallelSaveStrategyWrapper``; three async saves
through ``AsyncCallsQueue``, finalized as the training loop does; then a fresh job that
resumes through ``FullyParallelLoadStrategyWrapper`` and compares every value, and saves
once more reusing the loaded metadata; and a resume on one rank (another data-parallel
split, and another layout of the sharded weight, so megatron-core reshards the flattened
tensors with ``mcore_data``). The jobs never import mcore_autopatch; the wheel is installed
by pip in the venv, or not at all (``python_without_wheel``).

CUDA on a CPU-only machine: megatron-core calls ``torch.cuda`` on this path (the
all-reduce that asks whether an async save is done, ``synchronize()``, the load-time exchange
of replicated tensors on ``cuda``, the check that a resumed job may reuse the loaded
metadata). The job redirects exactly those to the CPU (tests/job_path/cpu_stand_in_for_cuda.py
lists them with 0.12.1's line numbers) and reports every site it redirected; the tests
check that every one lies in those modules. On a GPU machine nothing is redirected:
``make gpu-check`` runs the same job with its state on CUDA.

torch 2.9.0 and 2.11.0 drop ``mcore_data`` from the saved metadata (the second break);
2.8.0 and 2.13.0 keep it and are the oracles.
"""

import hashlib
import json
import os
import shutil
from typing import Any, Callable, Dict

import pytest
from conftest import (
    CPU_TORCH,
    TORCH_RELEASES,
    clean_env,
    compat_params,
    job_failure,
    mcore_folder,
    run_dir_folder,
    run_python,
    run_training_job,
    shared_once,
    torch_params,
)
from test_e2e_save import error_without_fix, release

pytestmark = pytest.mark.e2e

JOB_RELEASES = ["0.11.0", "0.12.1"]
DROPS_MCORE_DATA = ["2.9.0", "2.11.0"]  # FileSystemWriter.finish rebuilds the Metadata
ORACLES = ["2.8.0", CPU_TORCH]  # keep mcore_data: what the fixed save must equal
# 0.12.1 (the seed report's release) runs the job path on every torch; 0.11.0 (the
# four-argument call) where mcore_data is lost and on the oracles. Resharding on another
# split, which reads mcore_data's shapes, runs where mcore_data is lost and on 2.13.0.
# (torch 2.15.0 and numpy 2 for both releases: tests/test_e2e_fresh_stack.py.)
JOB_CELLS = [("0.12.1", t) for t in TORCH_RELEASES if t != "2.15.0"] + [("0.11.0", "2.9.0")]
# Where mcore_data is dropped without the fix: the fixed saves, compared with the oracles.
DROPPED_CELLS = [("0.12.1", t) for t in DROPS_MCORE_DATA] + [("0.11.0", "2.9.0")]
SPLIT_CELLS = [*DROPPED_CELLS, ("0.12.1", CPU_TORCH)]
NATIVE = "0.13.1"  # passes serialization_format itself; still loses mcore_data on 2.9-2.11
JOB = "job path: 3 async saves, resume, model + distributed-optimizer state equal"
JOB_SPLIT = "job path: resume on another data-parallel split (reshards flattened tensors)"
JOB_OFF = "job path, `MCORE_AUTOPATCH=0`: fails as today, or works natively"
# The megatron-core modules whose CUDA calls the CPU stand-in redirects (see its docstring).
CUDA_SITE_MODULES = {
    "core/dist_checkpointing/strategies/async_utils.py",
    "core/dist_checkpointing/strategies/filesystem_async.py",
    "core/dist_checkpointing/strategies/fully_parallel.py",
    "core/dist_checkpointing/strategies/state_dict_saver.py",
    "core/dist_checkpointing/exchange_utils.py",
    "core/dist_checkpointing/mapping.py",
}
N_D_FLATTENED = 9  # 3 optimizer states x 3 weights
MISSING_MCORE_DATA = "'Metadata' object has no attribute 'mcore_data'"


def drops_mcore_data(torch: str) -> bool:
    return (2, 9) <= release(torch) < (2, 12)


def saved(python: Callable[[str], str], torch: str, version: str, *args: str, wheel: bool = True) -> Dict[str, Any]:
    """The job's three saves on ``torch``, once per run; the result with its ``root``."""

    def save() -> Dict[str, Any]:
        root = run_dir_folder("job-%s-%s-" % (version, torch))
        result = run_training_job(python(torch), version, "save", root, *args)
        result["root"] = root
        return result

    name = "job-save-%s-%s-%s-%s" % (version, torch, "wheel" if wheel else "none", "-".join(args) or "full")
    return shared_once(name, save)


def copy_of(root: str) -> str:
    """A private copy of a saved job folder (resuming with --then-save writes into it)."""
    target = run_dir_folder("copy-")
    shutil.rmtree(target)
    shutil.copytree(root, target)
    return target


def metadata_of(result: Dict[str, Any]) -> Dict[str, Any]:
    return result["ranks"][0]["metadata"]


def assert_cuda_sites_documented(result: Dict[str, Any]) -> None:
    for rank in result["ranks"]:
        sites = rank.get("cuda_stand_in_sites") or {}
        undocumented = [s for s in sites if s.split(" at ")[-1].rsplit(":", 1)[0] not in CUDA_SITE_MODULES]
        assert not undocumented, "CUDA called where the stand-in does not document it: %s" % undocumented


# --- with the wheel: save and resume on every torch ------------------------------------------


def cells(pairs: "list[tuple[str, str]]", what: str) -> "list[Any]":
    pairs = sorted(pairs, key=lambda p: (release(p[1]), release(p[0])))
    return [pytest.param(v, t, marks=pytest.mark.compat(v, what), id="%s-torch%s" % (v, t)) for v, t in pairs]


@pytest.mark.parametrize("version,torch_release", cells(JOB_CELLS, JOB))
def test_job_saves_three_times_and_resumes_equal_with_the_wheel(torch_python, torch_release, version):
    save = saved(torch_python, torch_release, version)
    assert save["ok"], job_failure(save)
    assert all(rank["saved"] == [1, 2, 3] for rank in save["ranks"])
    assert all(rank["cached_structure_reused"] for rank in save["ranks"])  # --ckpt-assume-constant-structure
    metadata = metadata_of(save)
    flattened = {k: v for k, v in (metadata["mcore_data"] or {}).items() if v}
    assert len(flattened) == N_D_FLATTENED, metadata["mcore_data"]  # kept, on every torch
    assert flattened["optimizer.state.exp_avg.embedding.word_embeddings.weight"] == {
        "nd_reformulated_orig_global_shape": [8, 6]
    }
    assert metadata["all_local_plans"] == 2
    assert_cuda_sites_documented(save)

    resume = run_training_job(torch_python(torch_release), version, "resume", copy_of(save["root"]), "--then-save")
    assert resume["ok"], job_failure(resume)
    assert [rank["iteration"] for rank in resume["ranks"]] == [3, 3]
    assert all(rank["loaded_equal"] for rank in resume["ranks"])
    # A resumed job with the cached structure reuses the loaded metadata (all_local_plans kept).
    assert all(rank["plugged_loaded_metadata"] and rank["loaded_metadata_reused"] for rank in resume["ranks"])
    assert_cuda_sites_documented(resume)


@pytest.mark.parametrize("version,torch_release", cells(SPLIT_CELLS, JOB_SPLIT))
def test_job_resumes_on_another_data_parallel_split(torch_python, torch_release, version):
    """One rank: every flattened piece is whole, and the sharded weight's state is resharded,
    which needs the original shapes from mcore_data. Then two ranks with another split."""
    save = saved(torch_python, torch_release, version)
    assert save["ok"], job_failure(save)
    one = run_training_job(torch_python(torch_release), version, "resume", save["root"], ranks=1)
    assert one["ok"], job_failure(one)
    assert one["ranks"][0]["loaded_equal"] is True
    if torch_release == CPU_TORCH:  # the same on 2 ranks with the optimizer split elsewhere
        shifted = run_training_job(torch_python(torch_release), version, "resume", save["root"], "--split", "shifted")
        assert shifted["ok"], job_failure(shifted)


@pytest.mark.parametrize(
    "version,torch_release", [pytest.param(v, t, id="%s-torch%s" % (v, t)) for v, t in DROPPED_CELLS]
)
def test_job_metadata_saved_with_the_fix_equals_the_oracles(torch_python, torch_release, version):
    """What torch 2.9-2.11 write with the fix equals what 2.8.0 and 2.13.0 write natively: the
    same content, the same classes in the pickle (none of ours), the same .distcp bytes."""
    fixed = metadata_of(saved(torch_python, torch_release, version))
    for oracle in ORACLES:
        expected = metadata_of(saved(torch_python, oracle, version))
        for field in ("state_dict_metadata", "storage_data", "planner_data", "mcore_data", "all_local_plans"):
            assert fixed[field] == expected[field], (field, oracle)
        assert fixed["classes"] == expected["classes"], oracle
        assert not [c for c in fixed["classes"] if c.startswith("mcore_autopatch")]
        assert fixed["distcp"] == expected["distcp"], oracle


@pytest.mark.parametrize(
    "version,torch_release", [pytest.param(v, t, id="%s-torch%s" % (v, t)) for v, t in DROPPED_CELLS]
)
def test_job_checkpoint_saved_with_the_fix_resumes_in_images_without_it(
    torch_python, python_without_wheel, torch_release, version
):
    """Images without mcore-autopatch: the same megatron-core on the same torch; for 0.12.1
    also on torch 2.13.0 on one rank (another split) and, from 2.11.0, megatron-core 0.15.3
    (on 2.13.0: on a CUDA build of torch without a GPU its import compiles a CUDA extension)."""
    root = saved(torch_python, torch_release, version)["root"]
    same = run_training_job(python_without_wheel(torch_release), version, "resume", root)
    assert same["ok"], job_failure(same)
    if version != "0.12.1":
        return
    if torch_release == "2.9.0":
        other = run_training_job(python_without_wheel(CPU_TORCH), version, "resume", root, ranks=1)
        assert other["ok"], job_failure(other)
    else:
        newer = run_training_job(python_without_wheel(CPU_TORCH), "0.15.3", "resume", root)
        assert newer["ok"], job_failure(newer)


# --- without the fix -------------------------------------------------------------------------


@pytest.mark.parametrize("version", compat_params(["0.12.1"], JOB_OFF))
@pytest.mark.parametrize("torch_release", torch_params([t for t in TORCH_RELEASES if t not in ("2.11.0", "2.15.0")]))
def test_job_without_the_fix_fails_as_it_does_today(torch_python, torch_release, version):
    root = run_dir_folder("job-off-")
    save = run_training_job(torch_python(torch_release), version, "save", root, env={"MCORE_AUTOPATCH": "0"})
    error = error_without_fix(version, torch_release)
    if error is None:  # nothing missing for _write_item here, and this torch keeps mcore_data
        assert save["ok"], job_failure(save)
        assert not drops_mcore_data(torch_release)
        resume = run_training_job(torch_python(torch_release), version, "resume", root, ranks=1)
        assert resume["ok"], job_failure(resume)
        return
    assert not save["ok"]
    assert save["error"].startswith("RuntimeError: Worker failure"), save["error"]
    assert error in save["error"]
    assert not os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt"))


@pytest.mark.parametrize("version", compat_params([NATIVE], JOB))
@pytest.mark.parametrize("torch_release", torch_params(DROPS_MCORE_DATA))
def test_native_release_loses_mcore_data_without_the_wheel_and_keeps_it_with_it(
    torch_python, python_without_wheel, torch_release, version
):
    """megatron-core 0.13.1 writes _write_item's arguments itself, yet on 2.9-2.11 its saved
    checkpoint cannot be resumed: the second break. With the wheel it can."""
    lost = saved(python_without_wheel, torch_release, version, wheel=False)
    assert lost["ok"], job_failure(lost)
    assert metadata_of(lost)["mcore_data"] is None and metadata_of(lost)["all_local_plans"] is None
    today = run_training_job(python_without_wheel(torch_release), version, "resume", lost["root"])
    assert not today["ok"]
    assert MISSING_MCORE_DATA in today["error"]

    kept = saved(torch_python, torch_release, version)
    assert kept["ok"], job_failure(kept)
    assert metadata_of(kept)["mcore_data"] == metadata_of(saved(torch_python, CPU_TORCH, version))["mcore_data"]
    resume = run_training_job(torch_python(torch_release), version, "resume", copy_of(kept["root"]), "--then-save")
    assert resume["ok"], job_failure(resume)
    assert all(rank["loaded_metadata_reused"] for rank in resume["ranks"])


@pytest.mark.matrix
def test_persistent_worker_job_saves_and_resumes_on_torch_2_9(torch_python):
    """Megatron-LM's --async-ckpt-use-persistent-worker: the writes happen in a spawned
    process (which imports megatron afresh), the Metadata is finished in the rank."""
    save = saved(torch_python, "2.9.0", "0.12.1", "--persistent")
    assert save["ok"], job_failure(save)
    assert len({k for k, v in metadata_of(save)["mcore_data"].items() if v}) == N_D_FLATTENED
    resume = run_training_job(torch_python("2.9.0"), "0.12.1", "resume", save["root"], "--persistent", ranks=1)
    assert resume["ok"], job_failure(resume)


# --- checkpoints that already lack mcore_data --------------------------------------------------

LOST_TORCH = "2.9.0"


def lost_checkpoint(python_without_wheel: Callable[[str], str], *args: str) -> Dict[str, Any]:
    """Saved by native 0.13.1 on torch 2.9.0 in an image without mcore-autopatch."""
    lost = saved(python_without_wheel, LOST_TORCH, NATIVE, *args, wheel=False)
    assert lost["ok"], job_failure(lost)
    assert metadata_of(lost)["mcore_data"] is None
    return lost


@pytest.mark.matrix
def test_checkpoint_without_mcore_data_resumes_where_its_shapes_are_provable(torch_python, python_without_wheel):
    root = lost_checkpoint(python_without_wheel)["root"]
    python = torch_python(LOST_TORCH)
    # The layout of the save: the original shapes are never used.
    same = run_training_job(python, NATIVE, "resume", root)
    assert same["ok"], job_failure(same)
    # One rank: resharded, with the shapes proved from the model tensors saved beside them.
    one = run_training_job(python, NATIVE, "resume", root, ranks=1)
    assert one["ok"], job_failure(one)
    assert one["ranks"][0]["loaded_equal"] is True
    today = run_training_job(python, NATIVE, "resume", root, ranks=1, env={"MCORE_AUTOPATCH": "0"})
    assert not today["ok"] and MISSING_MCORE_DATA in today["error"]


@pytest.mark.matrix
def test_checkpoint_without_mcore_data_or_its_model_fails_clearly_in_another_layout(torch_python, python_without_wheel):
    root = lost_checkpoint(python_without_wheel, "--state", "optimizer-only")["root"]
    python = torch_python(LOST_TORCH)
    one = run_training_job(python, NATIVE, "resume", root, "--state", "optimizer-only", ranks=1)
    assert not one["ok"]
    error = one["error"]
    assert error.startswith("CheckpointingException: checkpoint "), error
    assert "has no mcore_data in its .metadata" in error and "torch 2.9-2.11 drop it" in error
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight (saved as (2, 1, 24)" in error
    assert "resume with the tensor- and pipeline-parallel sizes the checkpoint was saved with" in error
    assert "mcore-autopatch inspect" in error
    same = run_training_job(python, NATIVE, "resume", root, "--state", "optimizer-only")
    assert same["ok"], job_failure(same)


def _cli(python: str, *args: str, **env: str):
    return run_python(python, ["-m", "mcore_autopatch", *args], clean_env(PYTHONPATH=mcore_folder(NATIVE), **env))


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.matrix
def test_inspect_and_repair_a_checkpoint_without_mcore_data(torch_python, python_without_wheel):
    python = torch_python(LOST_TORCH)
    folder = os.path.join(copy_of(lost_checkpoint(python_without_wheel)["root"]), "iter_0000003")
    proc = _cli(python, "inspect", folder, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["written_by"] == "torch 2.9 or later (DCP format version 1.0.0)"
    assert report["mcore_data"] is False and report["unprovable"] == []
    assert len(report["n_d_flattened"]) == N_D_FLATTENED
    assert report["loads_here"].startswith("yes: mcore-autopatch's load guard recovers")
    assert report["repairable"] is True

    repaired = _cli(python, "repair", folder)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert os.path.exists(os.path.join(folder, ".metadata.before-mcore-autopatch-repair"))
    after = json.loads(_cli(python, "inspect", folder, "--json").stdout)
    assert after["mcore_data"] is True and after["loads_here"] == "yes: mcore_data is there"
    # What the repair wrote is what the fixed save writes, and an image without us reads it.
    kept = metadata_of(saved(torch_python, LOST_TORCH, NATIVE))["mcore_data"]
    expected = {k: v["nd_reformulated_orig_global_shape"] for k, v in kept.items() if v}
    assert {t["key"]: t["original_shape"] for t in after["tensors"] if t["original_shape"]} == expected
    resume = run_training_job(python_without_wheel(LOST_TORCH), NATIVE, "resume", os.path.dirname(folder), ranks=1)
    assert resume["ok"], job_failure(resume)


@pytest.mark.matrix
def test_repair_refuses_what_it_cannot_prove_and_changes_nothing(torch_python, python_without_wheel):
    python = torch_python(LOST_TORCH)
    root = copy_of(lost_checkpoint(python_without_wheel, "--state", "optimizer-only")["root"])
    folder = os.path.join(root, "iter_0000003")
    before = _digest(os.path.join(folder, ".metadata"))
    report = json.loads(_cli(python, "inspect", folder, "--json").stdout)
    assert len(report["unprovable"]) == N_D_FLATTENED and report["repairable"] is False
    assert report["loads_here"].startswith("only with the tensor- and pipeline-parallel sizes of the save")
    proc = _cli(python, "repair", folder)
    assert proc.returncode == 1
    assert proc.stdout.startswith("not repaired: the original shapes of 9 tensor(s) cannot be proved")
    assert _digest(os.path.join(folder, ".metadata")) == before
    original = os.path.join(lost_checkpoint(python_without_wheel, "--state", "optimizer-only")["root"], "iter_0000003")
    assert sorted(os.listdir(folder)) == sorted(os.listdir(original))  # no backup, no temporary file
    for bad in (os.path.join(root, "nowhere"), root):
        proc = _cli(python, "repair", bad)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith("mcore-autopatch repair: ") and "Traceback" not in proc.stderr


TENSOR_SHAPES = (
    "import json, sys, warnings; warnings.simplefilter('ignore')\n"
    "from megatron.core import dist_checkpointing\n"
    "try:\n"
    "    md = dist_checkpointing.load_tensors_metadata(sys.argv[1])\n"
    "    print(json.dumps({k: list(v.global_shape) for k, v in md.items()}))\n"
    "except Exception as exc:\n"
    "    print(json.dumps({'error': '%s: %s' % (type(exc).__name__, exc)}))\n"
)


def _tensor_shapes(python: str, folder: str, **env: str) -> Dict[str, Any]:
    proc = run_python(python, ["-c", TENSOR_SHAPES, folder], clean_env(PYTHONPATH=mcore_folder(NATIVE), **env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.matrix
def test_load_tensors_metadata_never_describes_a_wrong_shape(torch_python, python_without_wheel):
    python = torch_python(LOST_TORCH)
    key = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
    folder = os.path.join(lost_checkpoint(python_without_wheel)["root"], "iter_0000003")
    assert _tensor_shapes(python, folder, MCORE_AUTOPATCH="0")[key] == [2, 1, 24]  # today: wrong, silently
    assert _tensor_shapes(python, folder)[key] == [8, 6]  # proved from the model tensor
    bare = os.path.join(lost_checkpoint(python_without_wheel, "--state", "optimizer-only")["root"], "iter_0000003")
    refused = _tensor_shapes(python, bare)
    assert refused["error"].startswith("CheckpointingException: checkpoint "), refused
    assert "cannot be proved" in refused["error"]
