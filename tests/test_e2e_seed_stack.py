"""The seed report's own stack: megatron-core 0.12.1 installed into a torch 2.9.0 venv, with
the save made inside a Ray actor (as verl runs its Megatron workers).

The venv is `.cache/seed-stack` (tools/envs.py seed): real torch 2.9.0 (a CUDA build, saving
on gloo here), megatron-core 0.12.1 installed into site-packages with pip (not on
PYTHONPATH), and Ray from the registry. The driver starts a local Ray cluster on loopback and
stops it; the actor is a worker process started by Ray's raylet, which never imports
mcore_autopatch. With the wheel installed the save works; in a clone of the same venv
without the wheel the same job fails as reported.
"""

import os
import shutil
import signal
import subprocess
import tempfile
from typing import Any, Dict

import pytest
from conftest import ROOT, SEED_VENV_ENV, clean_env, compat_params, envs, last_json

pytestmark = pytest.mark.e2e

DRIVER = os.path.join(ROOT, "tests", "import_scripts", "ray_actor_save.py")
MISSING_FORMAT = "_write_item() missing 1 required positional argument: 'serialization_format'"


@pytest.fixture(scope="module")
def seed_python(wheel_path: str) -> str:
    python = os.environ.get(SEED_VENV_ENV)
    if not python:
        pytest.skip("the seed-stack venv is missing: run `make test-matrix-env` (python3 tools/envs.py seed)")
    return python


def run_driver(python: str, tmp_path: Any) -> Dict[str, Any]:
    """The Ray driver in a session of its own; its whole process group goes at the end."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    env = clean_env(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_DISABLE_IMPORT_WARNING="1",
        TORCHINDUCTOR_COMPILE_THREADS=None,  # torch's compile worker pool, as in the user's image
    )
    proc = subprocess.Popen(
        [python, DRIVER, str(tmp_path / "ckpt"), temp_dir],
        env=env,
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the cluster left behind
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)
    result = last_json(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    result["returncode"] = proc.returncode
    return result


def assert_ran_in_a_ray_worker(result: Dict[str, Any], python: str) -> None:
    assert result["actor_parent"] == "raylet"  # started by Ray, not forked from the driver
    assert result["actor_pid"] != result["driver_pid"]
    assert result["driver_imported_megatron"] is False
    site = envs.site_packages(python)
    assert result["megatron_core_file"] == os.path.join(site, "megatron", "core", "__init__.py")
    assert result["torch"].startswith(envs.SEED_TORCH + "+")


@pytest.mark.parametrize("version", compat_params([envs.SEED_MEGATRON], "Ray actor, installed in the venv (seed)"))
@pytest.mark.parametrize("torch_release", [pytest.param(envs.SEED_TORCH, id="torch" + envs.SEED_TORCH)])
def test_seed_stack_saves_inside_a_ray_actor_with_the_wheel(seed_python, tmp_path, torch_release, version):
    result = run_driver(seed_python, tmp_path)
    assert result["ok"], result.get("traceback") or result
    assert_ran_in_a_ray_worker(result, seed_python)
    assert result["startup_hook_ran"] is True
    assert result["write_item_replaced"] is True
    assert result["loaded_equal"] is True
    assert result["metadata_written"] is True


def test_seed_stack_without_the_wheel_fails_inside_the_ray_actor(seed_python, tmp_path):
    """A clone of the same venv that never had the wheel: the report's failure, unchanged."""
    bare = envs.clone_venv(envs.SEED, str(tmp_path / "seed-without-wheel"))
    result = run_driver(bare, tmp_path)
    assert_ran_in_a_ray_worker(result, bare)
    assert result["startup_hook_ran"] is False
    assert not result["ok"]
    assert result["write_item_replaced"] is False
    assert result["error"].startswith("RuntimeError: Worker failure")
    assert MISSING_FORMAT in result["error"]
    assert result["metadata_written"] is False
