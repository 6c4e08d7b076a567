"""megatron-core 0.17 - 0.19 and nvidia-resiliency-ext 0.5 - 0.7, which the registry does not serve.

``MCORE_AUTOPATCH_NEWEST_TREES`` names a folder of release trees: ``mcore-<version>/`` holding
the ``megatron/`` folder of a Megatron-LM checkout at ``core_v<version>``, and
``nvrx-<version>/`` holding the ``nvidia_resiliency_ext`` package of a checkout at
``v<version>`` and that distribution's metadata (``nvidia_resiliency_ext-<version>.dist-info``:
megatron-core 0.17+ check its version). CI has no such folder (no network but the registries,
and the project carries no code of theirs), so these tests skip there; docs/testing.md has what
they gave when a session ran them from the tags.

Each pair runs tests/job_path/training_job.py as Megatron-LM 0.17+ runs it: the persistent
worker (required for async saves from 0.16), nvidia-resiliency-ext's async strategy and queue
(the default) or megatron-core's own (``--async-strategy mcore``), two saves, then a fresh
resume that describes the checkpoint and loads it with ``raise_all``; and the faults of
tests/test_e2e_async_faults.py through nvidia-resiliency-ext's strategy.
"""

import os
from typing import Any, Dict, List

import pytest
from conftest import CPU_TORCH, envs, job_failure, run_dir_folder, run_training_job
from test_e2e_async_faults import (
    SLOW_SAVE_2,
    assert_every_rank_raised_with_the_reason,
    assert_the_job_saved_again,
    fault_bounds,
)

pytestmark = [pytest.mark.e2e, pytest.mark.matrix]

TREES_ENV = "MCORE_AUTOPATCH_NEWEST_TREES"
# (megatron-core, nvidia-resiliency-ext): 0.17+ require nvidia-resiliency-ext 0.6.0 or later.
PAIRS = [
    ("0.17.1", "0.6.0"),
    ("0.17.1", "0.7.0-main"),
    ("0.18.2", "0.6.0"),
    ("0.18.2", "0.7.0-main"),
    ("0.19.0", "0.6.0"),
    ("0.19.0", "0.7.0-main"),
]
MODEL = ["--state", "model", "--persistent"]  # 0.16+ save no flattened tensors


def tree_path(mcore: str, nvrx: str) -> str:
    root = os.environ.get(TREES_ENV)
    if not root:
        pytest.skip(
            "%s is not set: megatron-core %s and nvidia-resiliency-ext %s are not on the registry"
            % (TREES_ENV, mcore, nvrx)
        )
    folders = [os.path.join(root, "mcore-" + mcore), os.path.join(root, "nvrx-" + nvrx)]
    missing = [f for f in folders if not os.path.isdir(f)]
    if missing:
        pytest.skip("no release tree at %s" % ", ".join(missing))
    return os.pathsep.join(folders)


def pairs(strategies: List[str]) -> List[Any]:
    return [pytest.param(m, n, s, id="%s-nvrx%s-%s" % (m, n, s)) for m, n in PAIRS for s in strategies]


TORCHES = ["2.13.0", "2.15.0-numpy2"]


@pytest.fixture(scope="session")
def newest_python(torch_python, tmp_path_factory):
    """torch 2.15.0 (a CUDA build: triton comes with it), or 2.13.0 (the CPU wheel) with triton
    from the registry beside it: megatron-core 0.18+ import triton."""
    made: Dict[str, str] = {}

    def get(torch: str) -> str:
        if torch != CPU_TORCH:
            return torch_python(torch)
        if torch not in made:
            folder = str(tmp_path_factory.mktemp("newest") / "venv")
            python = envs.clone_venv(os.path.dirname(os.path.dirname(torch_python(CPU_TORCH))), folder)
            envs.pip_install(python, "triton")
            made[torch] = python
        return made[torch]

    return get


@pytest.mark.parametrize("torch", TORCHES)
@pytest.mark.parametrize("mcore,nvrx,strategy", pairs(["nvrx", "mcore"]))
def test_the_newest_releases_save_and_resume(newest_python, mcore, nvrx, strategy, torch):
    path = tree_path(mcore, nvrx)
    python = newest_python(torch)
    root = run_dir_folder("newest-%s-" % mcore)
    args = [*MODEL, "--async-strategy", strategy]
    save = run_training_job(python, mcore, "save", root, "--iterations", "2", *args, path=path)
    assert save["ok"], job_failure(save)
    resume = run_training_job(
        python, mcore, "resume", root, *args, "--read-metadata", "--strict", "raise_all", path=path
    )
    assert resume["ok"], job_failure(resume)
    assert all(r["loaded_equal"] and set(r["metadata_reads"].values()) == {True} for r in resume["ranks"])


@pytest.mark.parametrize("fault", ["enospc", "worker-kill", "preload-raises", "writer-sigkill"])
@pytest.mark.parametrize("mcore,nvrx", [("0.17.1", "0.6.0"), ("0.19.0", "0.7.0-main")])
def test_a_fault_fails_the_newest_releases_save_on_every_rank(newest_python, mcore, nvrx, fault):
    """Writers are threads in the worker there: a killed writer is a killed worker. The persistent
    worker, as Megatron-LM 0.16+ requires for async saves (and nvidia-resiliency-ext's default)."""
    path = tree_path(mcore, nvrx)
    root = run_dir_folder("newest-fault-%s-" % mcore)
    args = ["--scenario", "faults", "--fault", fault, "--persistent", *SLOW_SAVE_2, *MODEL, *fault_bounds(stall=False)]
    result = run_training_job(newest_python("2.15.0-numpy2"), mcore, "save", root, *args, path=path, timeout=600)
    result["root"] = root
    assert_every_rank_raised_with_the_reason(result, "worker-kill" if fault == "writer-sigkill" else fault)
    assert_the_job_saved_again(result)
