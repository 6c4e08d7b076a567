"""Real megatron-core saves and loads with the wheel installed: every release on every real torch.

Each case runs examples/checkpoint_job.py in a subprocess of one torch venv (2.13.0 CPU,
or a real CUDA build of 2.6.0, 2.7.1, 2.8.0, 2.9.0, 2.14.1 from the registry, saving on
gloo), with the wheel installed by pip and one megatron-core release on PYTHONPATH. The job
never imports mcore_autopatch. Where a release needs the fix on that torch, the fixed save
must load back equal and write `.distcp` files byte-identical to native megatron-core
0.13.1's on the same torch, and the same job with MCORE_AUTOPATCH=0 must fail the way that
torch fails. Where nothing is missing (everything on 2.6.0, 0.12.x on 2.7.x), both runs
must save natively with the writer untouched. ``status`` is read from the process that saved.
"""

import json
from typing import Optional, Tuple

import pytest
from conftest import (
    AFFECTED,
    AFFECTED_ON_EVERY_TORCH,
    CPU_TORCH,
    FIXED_IMPORT_ONLY,
    JOB,
    clean_env,
    compat_params,
    envs,
    matrix_params,
    mcore_folder,
    run_python,
    torch_params,
)

pytestmark = pytest.mark.e2e

MISSING_STORAGE_KEY = "_write_item() missing 1 required positional argument: 'storage_key'"
MISSING_FORMAT = "_write_item() missing 1 required positional argument: 'serialization_format'"
MISSING_TWO = "_write_item() missing 2 required positional arguments: 'storage_key' and 'serialization_format'"


def release(version: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3])


def error_without_fix(version: str, torch: str) -> Optional[str]:
    """The TypeError megatron-core ``version`` hits on real ``torch`` unfixed; None: it saves.

    torch ≤ 2.6 takes the four legacy arguments; 2.7 puts ``transforms`` first (0.12 passes
    it); 2.8 adds a required ``serialization_format`` (0.13 passes it).
    """
    t, m = release(torch), release(version)
    if t < (2, 7) or m >= (0, 13):
        return None
    if t < (2, 8):
        return MISSING_STORAGE_KEY if m < (0, 12) else None
    return MISSING_TWO if m < (0, 12) else MISSING_FORMAT


def expected_decision(version: str, torch: str, torch_label: str) -> Tuple[bool, str]:
    """(needed, reason) that status must give for megatron-core ``version`` on ``torch``."""
    t, m = release(torch), release(version)
    label = "megatron-core %s" % version
    if t < (2, 7):
        signature = "_write_item(stream, data, write_item, storage_key)"
        return False, "torch %s's %s is called correctly by every megatron-core release" % (torch_label, signature)
    if m >= (0, 13):
        return False, "%s passes serialization_format itself" % label
    missing = []
    if m < (0, 12):
        missing.append("transforms")
    if t >= (2, 8):
        missing.append("serialization_format")
    if not missing:
        return False, "%s passes everything torch %s's _write_item requires" % (label, torch_label)
    return True, "%s calls _write_item without %s; torch %s requires %s" % (
        label,
        " and ".join(missing),
        torch_label,
        "it" if len(missing) == 1 else "them",
    )


def assert_status(status: dict, version: str, torch: str, torch_label: str, applied: bool) -> None:
    needed, reason = expected_decision(version, torch, torch_label)
    assert status["megatron_core"] == version
    assert status["torch"] == torch_label
    assert (status["needed"], status["applied"]) == (needed, applied), status
    assert status["reason"] == reason
    assert status["hook_decision"] == {"needed": needed, "applied": applied, "reason": reason}


CPU_ONLY = [v for v in AFFECTED if v not in AFFECTED_ON_EVERY_TORCH]
PLAIN = "with the wheel: round trip equal, `.distcp` bytes = native 0.13.1, status"
PLAIN_OFF = "`MCORE_AUTOPATCH=0`: fails as that torch fails, or saves natively"
FIXED = "left untouched; saves natively; status"


def worker_error(version: str) -> str:
    """How a failed write surfaces: 0.6/0.7's workers lose the TypeError (it is on stderr)."""
    if release(version) < (0, 8):
        return "RuntimeError: Incomplete worker results"
    return "RuntimeError: Worker failure"


@pytest.mark.parametrize("version,torch_release", matrix_params(AFFECTED_ON_EVERY_TORCH, CPU_ONLY, PLAIN))
def test_affected_release_saves_and_loads_with_the_wheel(run_job, reference_digests, torch_release, version):
    result = run_job(version, torch=torch_release, status=True)
    assert result["ok"], result.get("traceback") or result
    assert result["torch"].split("+")[0] == torch_release
    assert result["loaded_equal"] is True
    assert result["metadata_written"] is True
    assert result["files"] == reference_digests("basic", torch=torch_release)
    needs_fix = error_without_fix(version, torch_release) is not None
    assert result["write_item_replaced"] is needs_fix  # never patched where nothing is missing
    assert_status(result["status"], version, torch_release, result["torch"], applied=needs_fix)


# Without the fix, on the real CUDA builds: 2.6.0 (nothing missing), 2.7.1 (transforms) and
# 2.8.0 (serialization_format); 2.9.0, 2.11.0 and 2.15.0 have 2.8.0's _write_item
# (test_fake_signatures_are_the_real_releases), and the job path fails on each of them.
OFF_TORCHES = ["2.6.0", "2.7.1", "2.8.0"]
OFF_PARAMS = [
    p for p in matrix_params(AFFECTED_ON_EVERY_TORCH, CPU_ONLY, PLAIN_OFF) if p.values[1] in [*OFF_TORCHES, CPU_TORCH]
]


def lacks_pkg_resources(torch_release: str) -> bool:
    """Whether the venv of ``torch_release`` has a setuptools without pkg_resources (82+)."""
    setuptools = envs.described(envs.E2E if torch_release == CPU_TORCH else envs.torch_venv_folder(torch_release))
    return release(setuptools.get("setuptools", "0")) >= (82,)


@pytest.mark.parametrize("version,torch_release", OFF_PARAMS)
def test_affected_release_without_the_fix_fails_as_that_torch_fails(
    run_job, torch_python, reference_digests, torch_release, version
):
    if version in ("0.7.0", "0.8.0") and lacks_pkg_resources(torch_release):
        # `from pkg_resources import packaging` at `import megatron.core`: no job at all.
        env = clean_env(PYTHONPATH=mcore_folder(version), MCORE_AUTOPATCH="0")
        proc = run_python(torch_python(torch_release), [JOB, "--json", "--no-load"], env)
        assert proc.returncode != 0
        assert "ModuleNotFoundError: No module named 'pkg_resources'" in proc.stderr
        return
    result = run_job(version, "--no-load", torch=torch_release, env={"MCORE_AUTOPATCH": "0"})
    assert result["write_item_replaced"] is False
    error = error_without_fix(version, torch_release)
    if error is None:  # nothing is missing on this torch: megatron-core's own save works
        assert result["ok"], result.get("traceback") or result
        assert result["files"] == reference_digests("basic", torch=torch_release)
        return
    assert not result["ok"]
    assert result["error"].startswith(worker_error(version)), result["error"]
    assert error in (result["error"] if release(version) >= (0, 8) else result["stderr"])
    assert result["metadata_written"] is False  # no checkpoint that looks complete


# 0.13.1 on torch 2.9.0 and 2.11.0 runs through the job path (it loses mcore_data there).
FIXED_PARAMS = [p for p in matrix_params(["0.13.1"], ["0.13.0"], FIXED) if p.values[1] not in ("2.9.0", "2.11.0")]


@pytest.mark.parametrize("version,torch_release", FIXED_PARAMS)
def test_fixed_release_is_left_untouched_and_saves(run_job, reference_digests, torch_release, version):
    result = run_job(version, torch=torch_release, status=True)
    assert result["ok"], result.get("traceback") or result
    assert result["write_item_replaced"] is False
    assert result["files"] == reference_digests("basic", torch=torch_release)
    assert_status(result["status"], version, torch_release, result["torch"], applied=False)


# --- the command line on each torch ---------------------------------------------------------


def cli(python: str, args: list, version: str, **env: str):
    return run_python(python, ["-m", "mcore_autopatch", *args], clean_env(PYTHONPATH=mcore_folder(version), **env))


# Each torch where the writer's decision differs (2.11.0 decides as 2.9.0, 2.15.0 as 2.13.0).
DECISION_TORCHES = ["2.6.0", "2.7.1", "2.8.0", "2.9.0", "2.13.0"]


@pytest.mark.parametrize("version", compat_params(["0.12.1"], "`status --json` and `check` from the command line"))
@pytest.mark.parametrize("torch_release", torch_params(DECISION_TORCHES))
def test_status_json_and_check_on_each_torch(torch_python, torch_release, version):
    python = torch_python(torch_release)
    proc = cli(python, ["status", "--json"], version)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    needs_fix = error_without_fix(version, torch_release) is not None
    assert info["hook_installed"] is True
    assert_status(info, version, torch_release, info["torch"], applied=needs_fix)
    check = cli(python, ["check"], version)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.startswith("ok: fix %s (" % ("active" if needs_fix else "not needed"))


@pytest.mark.parametrize("torch_release", torch_params(["2.6.0", "2.8.0", "2.13.0"]))
def test_check_with_the_fix_off_fails_and_names_what_is_not_active(torch_python, torch_release):
    """With MCORE_AUTOPATCH=0 the gate fails on every torch: the writer fix where the save
    breaks (0.9.0 from 2.7, 0.12.1 from 2.8), and on 2.6.0, where saves work, the guard for
    loading checkpoints that lost mcore_data (0.9.0 reads it); each reason is named."""
    version = "0.9.0" if release(torch_release) < (2, 8) else "0.12.1"
    check = cli(torch_python(torch_release), ["check"], version, MCORE_AUTOPATCH="0")
    assert check.returncode == 1, check.stdout + check.stderr
    assert check.stdout.startswith("FAIL: fix needed but not active in this interpreter: MCORE_AUTOPATCH=0")
    assert "megatron-core load_without_mcore_data: megatron-core %s needs mcore_data" % version in check.stdout
    writer_breaks = error_without_fix(version, torch_release) is not None
    assert ("fix: megatron-core %s calls _write_item without" % version in check.stdout) is writer_breaks


# --- the fakes of the unit tests are the real signatures --------------------------------------

SIGNATURE = (
    "import inspect, json, torch.distributed.checkpoint.filesystem as fs; "
    "print(json.dumps([[p.name, p.kind.name, p.default is p.empty, repr(p.default)] "
    "for p in inspect.signature(fs._write_item).parameters.values()]))"
)


def parameters(function) -> list:
    import inspect

    params = inspect.signature(function).parameters.values()
    return [[p.name, p.kind.name, p.default is p.empty, repr(p.default)] for p in params]


@pytest.mark.parametrize("torch_release", torch_params())
def test_fake_signatures_are_the_real_releases(torch_python, torch_release):
    """tests/fakes' _write_item of each released generation has the real release's parameters."""
    from fakes import fake_torch_write_items as fake

    generation = "2.6" if release(torch_release) < (2, 7) else "2.7" if release(torch_release) < (2, 8) else "2.8"
    proc = run_python(torch_python(torch_release), ["-c", SIGNATURE], clean_env())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == parameters(fake.FAKE_GENERATIONS[generation])


# --- torch 2.13.0 only ----------------------------------------------------------------------


@pytest.mark.parametrize("version", compat_params(["0.9.0", "0.12.1"], "every dtype, a view, objects: bytes = native"))
def test_rich_state_round_trip_is_byte_identical_to_native_0_13_1(run_job, reference_digests, version):
    """float32, bfloat16, float16, int64, uint8, bool, a non-contiguous view, objects."""
    result = run_job(version, "--state", "rich")
    assert result["ok"], result.get("traceback") or result
    assert result["mismatched"] == []
    assert result["files"] == reference_digests("rich")


def _status(e2e_python, version, **env):
    proc = run_python(
        e2e_python, ["-m", "mcore_autopatch", "status", "--json"], clean_env(PYTHONPATH=mcore_folder(version), **env)
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("version", compat_params(FIXED_IMPORT_ONLY, "`status`: not needed, not applied"))
def test_status_says_newer_releases_need_nothing(e2e_python, version):
    """0.14+ no longer save on a CPU-only machine; status still reads them right."""
    info = _status(e2e_python, version)
    assert info["megatron_core"] == version
    assert (info["needed"], info["applied"]) == (False, False)
    assert info["reason"] == "megatron-core %s passes serialization_format itself" % version


# The everyday tier proves the plain round trip, its failure without the fix and the
# untouched fixed release on 0.9.0 (four arguments), 0.12.1 (transforms first) and 0.13.1
# on torch 2.13.0; the other releases' cells of 2.13.0 run in the matrix.
MATRIX_CELLS = {
    *("test_affected_release_saves_and_loads_with_the_wheel[%s-torch2.13.0]" % v for v in AFFECTED),
    *("test_affected_release_without_the_fix_fails_as_that_torch_fails[%s-torch2.13.0]" % v for v in AFFECTED),
    "test_fixed_release_is_left_untouched_and_saves[0.13.0-torch2.13.0]",
    "test_status_says_newer_releases_need_nothing[0.14.0]",
    "test_status_says_newer_releases_need_nothing[0.15.3]",
    "test_rich_state_round_trip_is_byte_identical_to_native_0_13_1[0.9.0]",
} - {
    "test_affected_release_saves_and_loads_with_the_wheel[0.9.0-torch2.13.0]",
    "test_affected_release_saves_and_loads_with_the_wheel[0.12.1-torch2.13.0]",
    "test_affected_release_without_the_fix_fails_as_that_torch_fails[0.12.1-torch2.13.0]",
}
