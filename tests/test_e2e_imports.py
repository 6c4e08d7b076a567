"""Every way the writer module can be imported, and other finders beside ours on sys.meta_path.

Each case runs a small script from tests/import_scripts/ (named after the situation) in a
subprocess of the e2e venv: torch 2.13.0, the wheel installed by pip, megatron-core
0.12.1 (0.9.0 where the shape of the ``_write_item`` call matters). Every script does a
real async save (``dist_checkpointing.save(..., async_sharded_save=True)``,
``execute_sync()``) and a load, and prints one JSON line with what the writer module's
``_write_item`` is: mcore-autopatch's safe caller (``__mcore_autopatch__``) wrapping
torch's original exactly once, or not. Scripts import mcore_autopatch only where the case
is about ``install()`` or ``status()``.
"""

import os
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Sequence

import pytest
from conftest import clean_env, last_json, mcore_folder, run_python

pytestmark = pytest.mark.e2e

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "import_scripts")
VERSION = "0.12.1"
MISSING_FORMAT = "_write_item() missing 1 required positional argument: 'serialization_format'"
APPLIED_LINE = "INFO: megatron-core write_item: applied:"


def run_script(
    python: str,
    script: str,
    *args: str,
    flags: Sequence[str] = (),
    version: str = VERSION,
    pythonpath: bool = True,
    env: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    """Run ``import_scripts/<script>``; its JSON result, with ``stderr`` and ``returncode`` added.

    ``pythonpath`` puts the megatron-core release on ``PYTHONPATH``; scripts run with
    ``-S``/``-I``/``-E`` get their paths as ``--path`` arguments instead.
    """
    extra: Dict[str, Optional[str]] = {"PYTHONPATH": mcore_folder(version) if pythonpath else None}
    extra.update(env or {})
    proc = run_python(python, [*flags, os.path.join(SCRIPTS, script), *args], clean_env(**extra), timeout=300)
    result = last_json(proc)
    result["stderr"] = proc.stderr
    result["returncode"] = proc.returncode
    return result


def assert_saved(save: Dict[str, Any]) -> None:
    assert save["ok"], save.get("traceback") or save
    assert save["loaded_equal"] is True


def assert_fixed_once(report: Dict[str, Any]) -> None:
    """``_write_item`` is ours, and its ``__wrapped__`` is torch's original itself."""
    assert report["marked"], report
    assert report["wraps_torch_once"], report
    assert report["levels"] == 1, report


def assert_save_fails_unfixed(save: Dict[str, Any], message: str = MISSING_FORMAT) -> None:
    assert not save["ok"]
    assert save["error"].startswith("RuntimeError: Worker failure"), save["error"]
    assert message in save["error"]


def ckpt(tmp_path: Any) -> str:
    return str(tmp_path / "ckpt")


# 1. importlib.reload


def test_reload_of_writer_and_strategies_torch_stays_fixed(e2e_python, tmp_path):
    """A reload re-executes ``from torch... import _write_item``; the hook must fix it again, once."""
    result = run_script(e2e_python, "reload_modules.py", ckpt(tmp_path))
    assert_fixed_once(result["imported"])
    assert result["same_module_after_reload"] is True
    assert_fixed_once(result["after_writer_reload"])
    assert_fixed_once(result["after_strategies_reload"])
    assert result["class_used_by_strategy"]["marked"] is True  # what write_preloaded_data resolves
    assert_saved(result["save"])


# 2. del sys.modules[...] and import again


def test_reimport_after_del_sys_modules_is_fixed_again_never_double_wrapped(e2e_python, tmp_path):
    """A second module object from the same file wraps torch's original, not the first wrapper."""
    result = run_script(e2e_python, "reimport_after_del.py", ckpt(tmp_path))
    assert result["new_module"] is True
    assert_fixed_once(result["first"])
    assert_fixed_once(result["second"])
    assert_fixed_once(result["first_after"])
    assert result["strategy_uses_second"] is True
    assert result["class_used_by_strategy"]["marked"] is True
    assert_saved(result["save"])


# 3. python -S: writer imported before install()


def _late_install_args(site_packages: str, tmp_path: Any) -> List[str]:
    return [ckpt(tmp_path), "--path", site_packages, "--path", mcore_folder(VERSION)]


def test_writer_imported_before_install_is_fixed_at_once_and_second_install_adds_nothing(
    e2e_python, e2e_site_packages, tmp_path
):
    """``python -S`` runs no .pth; ``install()`` after the import fixes the loaded module now."""
    result = run_script(
        e2e_python, "late_install.py", *_late_install_args(e2e_site_packages, tmp_path), flags=["-S"], pythonpath=False
    )
    assert result["no_site"] is True
    assert result["finders_at_start"] == []  # -S really kept our .pth from running
    assert result["before_install"]["is_torch_original"] is True
    assert result["first_install"] is True
    assert_fixed_once(result["after_first_install"])
    assert result["second_install"] is True
    assert_fixed_once(result["after_second_install"])
    assert len(result["finders"]) == 1, result["finders"]
    assert "install()" in result["finders"][0]
    assert_saved(result["save"])
    assert result["status_applied"] is True


# 4. -I, -E, -s


@pytest.mark.parametrize("flag", ["-I", "-E", "-s"])
def test_startup_flag_still_processes_site_packages_pth_and_saves(e2e_python, tmp_path, flag):
    """These flags drop PYTHONPATH, the script folder or the user site, never site-packages' .pth."""
    result = run_script(
        e2e_python,
        "startup_flags.py",
        ckpt(tmp_path),
        "--path",
        mcore_folder(VERSION),
        flags=[flag],
        pythonpath=False,
    )
    expected = {"-I": "isolated", "-E": "ignore_environment", "-s": "no_user_site"}[flag]
    assert result["flags"][expected] == 1
    assert result["flags"]["no_site"] == 0
    assert len(result["finders"]) == 1, result["finders"]
    assert "(startup)" in result["finders"][0]
    assert_saved(result["save"])
    assert_fixed_once(result["report"])


# 5. site-packages processed twice


def test_site_packages_processed_again_keeps_exactly_one_finder(e2e_python, tmp_path):
    """gh-75723: ``site.addsitedir`` reruns our .pth (even with a second copy of the module)."""
    result = run_script(e2e_python, "site_processed_twice.py", ckpt(tmp_path))
    assert result["pth_present"] is True
    assert all(runs >= 1 for runs in result["runs"]), result["runs"]  # our .pth line did run each time
    assert len(result["finders_at_start"]) == 1
    assert result["finders_after_twice"] == result["finders_at_start"]
    assert result["second_copy_imported"] is True
    assert result["finders_after_second_copy"] == result["finders_at_start"]
    assert_saved(result["save"])
    assert_fixed_once(result["report"])


# 6. eight threads at once


def test_eight_threads_importing_writer_at_once_apply_fix_once(e2e_python, tmp_path):
    """Concurrent imports must neither fail nor apply (or log) the fix twice."""
    result = run_script(e2e_python, "threaded_import.py", ckpt(tmp_path), env={"MCORE_AUTOPATCH_LOG": "debug"})
    assert result["errors"] == []
    assert result["imported_by"] == 8
    assert result["distinct_modules"] == 1
    ours = [line for line in result["stderr"].splitlines() if line.startswith("mcore_autopatch[pid ")]
    assert len([line for line in ours if APPLIED_LINE in line]) == 1, ours
    assert not [line for line in ours if "again (re-import)" in line or "WARNING" in line], ours
    assert len(result["finders"]) == 1
    assert_fixed_once(result["report"])
    assert_saved(result["save"])


# 7. importlib.util.LazyLoader


def test_lazy_loader_import_is_fixed_after_first_attribute_access(e2e_python, tmp_path):
    """LazyLoader runs the module body (and so our callback) on first attribute access."""
    result = run_script(e2e_python, "lazy_loader.py", ckpt(tmp_path))
    assert result["lazy_before_access"] is True
    assert result["class_name"] == "FileSystemWriterAsync"
    assert result["lazy_after_access"] is False
    assert_fixed_once(result["report"])
    assert_saved(result["save"])
    assert result["same_module_after_save"] is True


# 8. pytest's assertion-rewriting hook ahead of ours


def _pytest_session(python: str, folder: Any, **env: str) -> subprocess.CompletedProcess:
    """A real pytest run of assertion_rewriting_session.py in a folder of its own."""
    folder.mkdir()
    shutil.copy(os.path.join(SCRIPTS, "assertion_rewriting_session.py"), str(folder / "test_save_under_pytest.py"))
    (folder / "pytest.ini").write_text("[pytest]\n")  # rootdir here: none of this repo's conftest or config
    environment = clean_env(PYTHONPATH=mcore_folder(VERSION), IMPORT_SCRIPTS_DIR=SCRIPTS, **env)
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(folder / "tmp")]
    return run_python(python, [*args, "test_save_under_pytest.py"], environment, timeout=300, cwd=str(folder))


def test_pytest_assertion_rewriting_hook_first_save_passes_and_fails_when_off(private_venv, tmp_path):
    """pytest puts its AssertionRewritingHook at sys.meta_path[0]; our finder behind it still works."""
    pip = subprocess.run(
        [private_venv, "-m", "pip", "install", "-q", "--disable-pip-version-check", "pytest"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    fixed = _pytest_session(private_venv, tmp_path / "fixed")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "1 passed" in fixed.stdout
    off = _pytest_session(private_venv, tmp_path / "off", MCORE_AUTOPATCH="0")
    assert off.returncode == 1, off.stdout + off.stderr
    assert "1 failed" in off.stdout
    assert MISSING_FORMAT in off.stdout


# 9. a finder ahead of ours that claims megatron-core modules


def test_finder_claiming_writer_ahead_of_ours_is_fixed_after_the_fact_with_warning(e2e_python, tmp_path):
    """Our finder never sees the writer; the callback on ``strategies.torch`` (which imports it) fixes it."""
    result = run_script(
        e2e_python, "claiming_finder.py", ckpt(tmp_path), "--claim", "writer", env={"MCORE_AUTOPATCH_LOG": "warning"}
    )
    assert result["writer_loader"] == "ClaimingLoader"  # the other finder really loaded it
    assert_saved(result["save"])
    assert_fixed_once(result["report"])
    warnings = [line for line in result["stderr"].splitlines() if "WARNING:" in line and "mcore_autopatch" in line]
    assert len(warnings) == 1, result["stderr"][-3000:]
    assert "was loaded without mcore_autopatch's finder" in warnings[0]
    assert "ClaimingLoader" in warnings[0]
    assert result["status"]["needed"] is True
    assert result["status"]["applied"] is True
    assert result["check"][0] == 0


def test_finder_claiming_whole_megatron_tree_leaves_save_failing_and_status_says_not_applied(e2e_python, tmp_path):
    """The limit, documented: a finder that loads all of ``megatron`` itself hides every import from us.

    Then nothing can fix the writer; what must hold is that ``status()`` and ``check`` say so
    instead of claiming the fix is active.
    """
    result = run_script(e2e_python, "claiming_finder.py", ckpt(tmp_path), "--claim", "megatron")
    assert result["writer_loader"] == "ClaimingLoader"
    assert_save_fails_unfixed(result["save"])
    assert result["report"]["is_torch_original"] is True
    assert result["status"]["hook_installed"] is True
    assert result["status"]["needed"] is True
    assert result["status"]["applied"] is False
    assert result["check"][0] == 1  # NEEDED_NOT_ACTIVE
    assert result["check"][1].startswith("FAIL: fix needed but not active")


# 10. a job that carries its own fix


def _job_fix(python: str, tmp_path: Any, fix: str, order: str, version: str = VERSION, site: str = "") -> Dict:
    args = [ckpt(tmp_path), "--fix", fix, "--order", order]
    if order == "job-first-install":  # python -S, paths by hand, install() after the job's fix
        args += ["--path", site, "--path", mcore_folder(version)]
        return run_script(python, "job_own_fix.py", *args, flags=["-S"], version=version, pythonpath=False)
    return run_script(python, "job_own_fix.py", *args, version=version)


def assert_no_argument_twice(save: Dict[str, Any]) -> None:
    assert_saved(save)
    assert "multiple values" not in str(save.get("error"))


@pytest.mark.parametrize("version", [VERSION, "0.9.0"])
def test_verl_style_method_replacement_after_ours_saves_with_the_jobs_code(e2e_python, tmp_path, version):
    """verl-style: the job's own ``write_preloaded_data`` supplies every argument; ours stays unused."""
    result = _job_fix(e2e_python, tmp_path, "verl", "ours-first", version)
    assert_fixed_once(result["ours_before_job_fix"])
    assert_no_argument_twice(result["save"])
    assert result["job_calls"] >= 1  # the job's _write_item did the writing
    assert_fixed_once(result["report"])  # our rebinding is still there, untouched


def test_verl_style_method_replacement_then_writer_reload_saves_with_ours(e2e_python, tmp_path):
    """Ours applied after the job's (on reload): the reload rebuilds the class, so ours does the writing.

    megatron-core looks ``FileSystemWriterAsync`` up by name when it starts the write
    workers, so after a reload the fresh class (the job's method is on the old one) runs,
    with our module-level fix.
    """
    result = _job_fix(e2e_python, tmp_path, "verl", "job-first-reload")
    assert_no_argument_twice(result["save"])
    assert result["job_calls"] == 0
    assert_fixed_once(result["report"])


def test_verl_style_method_replacement_before_late_install_saves_with_the_jobs_code(
    e2e_python, e2e_site_packages, tmp_path
):
    """``install()`` after the job's fix: both are in place, the job's copy writes, nothing twice."""
    result = _job_fix(e2e_python, tmp_path, "verl", "job-first-install", site=e2e_site_packages)
    assert result["ours_before_job_fix"]["is_torch_original"] is True
    assert result["install"] is True
    assert_no_argument_twice(result["save"])
    assert result["job_calls"] >= 1
    assert_fixed_once(result["report"])
    assert result["status_applied"] is True


@pytest.mark.parametrize("version", [VERSION, "0.9.0"])
def test_swift_style_keyword_shim_over_ours_saves_without_multiple_values(e2e_python, tmp_path, version):
    """ms-swift-style: a shim adds ``serialization_format=`` by keyword and calls ours, which adds nothing twice.

    On 0.9.0 the shim alone is not enough (the call lacks transforms); ours, under it,
    supplies them (see the MCORE_AUTOPATCH=0 case below).
    """
    result = _job_fix(e2e_python, tmp_path, "swift-keyword", "ours-first", version)
    assert result["shim_wraps_ours"] is True
    assert_no_argument_twice(result["save"])
    assert result["job_calls"] >= 1
    assert result["report"]["name"].endswith("job_shim")


def test_swift_style_keyword_shim_before_late_install_is_left_alone_and_saves(e2e_python, e2e_site_packages, tmp_path):
    """A job's shim already in the module global when ``install()`` runs is not replaced or wrapped."""
    result = _job_fix(e2e_python, tmp_path, "swift-keyword", "job-first-install", site=e2e_site_packages)
    assert result["install"] is True
    assert result["report"]["marked"] is False
    assert result["report"]["name"].endswith("job_shim")
    assert_no_argument_twice(result["save"])
    assert result["job_calls"] >= 1


def test_positional_shim_over_ours_saves_without_multiple_values(e2e_python, tmp_path):
    """A shim that adds the format as the 6th positional argument: ours must not add it by keyword too."""
    result = _job_fix(e2e_python, tmp_path, "swift-positional", "ours-first")
    assert result["shim_wraps_ours"] is True
    assert_no_argument_twice(result["save"])
    assert result["job_calls"] >= 1


# The same scripts with MCORE_AUTOPATCH=0: the cases above pass because of the fix.

OFF_CASES = {
    "reload": ("reload_modules.py", [], [], VERSION, MISSING_FORMAT),
    "reimport": ("reimport_after_del.py", [], [], VERSION, MISSING_FORMAT),
    "late_install": ("late_install.py", ["SITE"], ["-S"], VERSION, MISSING_FORMAT),
    "isolated": ("startup_flags.py", ["MEGATRON"], ["-I"], VERSION, MISSING_FORMAT),
    "threads": ("threaded_import.py", [], [], VERSION, MISSING_FORMAT),
    "lazy_loader": ("lazy_loader.py", [], [], VERSION, MISSING_FORMAT),
    "claiming_finder": ("claiming_finder.py", ["--claim", "writer"], [], VERSION, MISSING_FORMAT),
    "swift_shim_0.9.0": (
        "job_own_fix.py",
        ["--fix", "swift-keyword", "--order", "ours-first"],
        [],
        "0.9.0",
        "_write_item() missing 1 required positional argument: 'storage_key'",
    ),
}


@pytest.mark.parametrize("case", list(OFF_CASES))
def test_import_situation_fails_with_mcore_autopatch_off(e2e_python, e2e_site_packages, tmp_path, case):
    """MCORE_AUTOPATCH=0: the same script's save fails the way the bug fails, and nothing is rebound."""
    script, extra, flags, version, message = OFF_CASES[case]
    args = [ckpt(tmp_path)]
    for arg in extra:
        if arg == "SITE":
            args += ["--path", e2e_site_packages, "--path", mcore_folder(version)]
        elif arg == "MEGATRON":
            args += ["--path", mcore_folder(version)]
        else:
            args.append(arg)
    result = run_script(
        e2e_python,
        script,
        *args,
        flags=flags,
        version=version,
        pythonpath=not flags,
        env={"MCORE_AUTOPATCH": "0"},
    )
    assert_save_fails_unfixed(result["save"], message)
    reports = [value for key, value in result.items() if isinstance(value, dict) and "marked" in value]
    assert reports and not any(report["marked"] for report in reports), result
    if case == "late_install":
        assert result["first_install"] is False
        assert result["finders"] == []


# Each import situation runs with the package in the everyday tier; most of its twins with
# MCORE_AUTOPATCH=0 (which show the situation really needs the fix) and 0.9.0's shims run
# in the matrix.
MATRIX_CELLS = {
    "test_verl_style_method_replacement_after_ours_saves_with_the_jobs_code[0.9.0]",
    "test_swift_style_keyword_shim_over_ours_saves_without_multiple_values[0.9.0]",
    "test_startup_flag_still_processes_site_packages_pth_and_saves[-E]",
    "test_startup_flag_still_processes_site_packages_pth_and_saves[-s]",
    *("test_import_situation_fails_with_mcore_autopatch_off[%s]" % case for case in OFF_CASES if case != "threads"),
}


# --- a decision that does not depend on the order of imports -----------------------------------------

STATUS_AFTER = """
import importlib, json, sys
if sys.argv[1] == "reimported-after-its-allowlist":
    import megatron.core  # its __init__ imports strategies.common before megatron.core.safe_globals
    assert "megatron.core.safe_globals" in sys.modules
    name = "megatron.core.dist_checkpointing.strategies.common"
    del sys.modules[name]
    importlib.import_module(name)  # the hook decides again, the allowlist's module imported now
else:
    import megatron.core.dist_checkpointing.strategies.common
import mcore_autopatch
row = next(f for f in mcore_autopatch.status()["fixes"] if f["fix"] == "torch_load_weights_only")
print(json.dumps({"needed": row["needed"], "applied": row["applied"], "hook": row["hook_decision"]}))
"""


@pytest.mark.parametrize("order", ["imported-as-a-job-does", "reimported-after-its-allowlist"])
def test_status_and_the_log_say_the_same_of_megatron_core_0_14_in_any_import_order(e2e_python, order):
    """megatron-core 0.14's allowlist module is imported after its checkpointing code: the hook and
    status read the same code, whichever was imported first, and say needed and applied."""
    env = clean_env(PYTHONPATH=mcore_folder("0.14.0"), MCORE_AUTOPATCH_LOG="info")
    proc = run_python(e2e_python, ["-c", STATUS_AFTER, order], env, timeout=300)
    result = last_json(proc)
    assert (result["needed"], result["applied"]) == (True, True), result
    assert (result["hook"]["needed"], result["hook"]["applied"]) == (True, True), result
    logged = [ln for ln in proc.stderr.splitlines() if "INFO: megatron-core torch_load_weights_only: applied" in ln]
    assert logged and "its own allowlist, megatron.core.safe_globals" in logged[-1], proc.stderr[-3000:]
