"""The wheel, and what pip makes of it: the startup files travel, install and uninstall.

A ``.pth`` must sit at the top of site-packages, outside any package, so setup.py carries
``mcore_autopatch.pth`` and ``mcore_autopatch.start`` at the wheel root (and into editable
wheels). These tests read the built wheel, then install it with pip into small venvs
without torch, the way a user would, and check that ``pip uninstall`` leaves nothing behind.
"""

import csv
import email.parser
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from typing import Dict, List

import pytest
from conftest import ROOT, clean_env, envs, run_python
from packaging.markers import Marker
from packaging.requirements import Requirement

# Pinned byte for byte: a security reviewer reads these two files, so any change to them
# must be a deliberate change to this test too.
PTH_CONTENT = 'import sys; exec("try:\\n import mcore_autopatch as m; m.activate()\\nexcept Exception: pass")\n'
START_CONTENT = "mcore_autopatch:activate\n"
STARTUP_FILES = ("mcore_autopatch.pth", "mcore_autopatch.start")
SOURCES = envs.SOURCES  # what the wheel is built from
# Counts finders on sys.meta_path put there by any copy of mcore_autopatch.
COUNT_FINDERS = "sum(type(f).__module__ == 'mcore_autopatch' for f in sys.meta_path)"


def wheel_names(wheel: str) -> List[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def wheel_text(wheel: str, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(suffix)]
        return zf.read(name).decode("utf-8")


def make_pip_venv(folder: str) -> str:
    """A venv with its own pip (ensurepip), as a user creates one; no torch."""
    subprocess.run([sys.executable, "-m", "venv", folder], check=True, capture_output=True, timeout=300)
    return os.path.join(folder, "bin", "python")


def pip(python: str, *args: str, cwd: "str | None" = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=clean_env(),
    )
    assert proc.returncode == 0, "pip %s failed:\n%s\n%s" % (" ".join(args), proc.stdout, proc.stderr[-4000:])
    return proc


def site_packages(python: str) -> str:
    proc = run_python(python, ["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], clean_env())
    return proc.stdout.strip()


def finder_count(python: str, cwd: str) -> int:
    proc = run_python(python, ["-c", "import sys; print(%s)" % COUNT_FINDERS], clean_env(), cwd=cwd)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return int(proc.stdout)


def our_files(folder: str) -> List[str]:
    return sorted(n for n in os.listdir(folder) if "mcore_autopatch" in n or n.startswith("__editable__"))


# --- the wheel itself ------------------------------------------------------------------


def test_wheel_root_carries_pth_and_start_and_record_lists_them(wheel_path):
    """pip only installs (and uninstall only removes) files the wheel holds and RECORD lists."""
    names = wheel_names(wheel_path)
    for name in (*STARTUP_FILES, "mcore_autopatch/py.typed", "mcore_autopatch/__init__.py"):
        assert name in names
    record = wheel_text(wheel_path, ".dist-info/RECORD")
    recorded = {row[0] for row in csv.reader(io.StringIO(record)) if row}
    for name in (*STARTUP_FILES, "mcore_autopatch/py.typed"):
        assert name in recorded


def test_wheel_holds_no_tests_tools_or_examples(wheel_path):
    """Only the package, the two startup files and the metadata ship."""
    names = wheel_names(wheel_path)
    for name in names:
        top = name.split("/", 1)[0]
        assert top not in ("tests", "tools", "examples", "bench", "scripts", "build", "dist"), name
        assert top in ("mcore_autopatch", *STARTUP_FILES) or top.endswith(".dist-info"), name
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_wheel_metadata_requires_packaging_but_never_torch_or_megatron(wheel_path):
    """Installing the fix must never change the torch (or megatron-core) of an image."""
    metadata = email.parser.Parser().parsestr(wheel_text(wheel_path, ".dist-info/METADATA"))
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    by_name: Dict[str, Requirement] = {r.name.lower().replace("_", "-"): r for r in requirements}
    assert set(by_name) == {"packaging", "importlib-metadata"}
    assert by_name["packaging"].marker is None
    marker = by_name["importlib-metadata"].marker
    assert marker is not None and str(marker) == str(Marker('python_version < "3.10"'))
    assert marker.evaluate({"python_version": "3.9"}) and not marker.evaluate({"python_version": "3.10"})
    assert metadata["Requires-Python"] == ">=3.8"
    assert metadata["Name"] == "mcore-autopatch"


def test_wheel_declares_the_mcore_autopatch_console_script(wheel_path):
    entry_points = wheel_text(wheel_path, ".dist-info/entry_points.txt")
    section = entry_points.split("[console_scripts]", 1)[1].split("[", 1)[0]
    lines = [ln.replace(" ", "") for ln in section.splitlines() if ln.strip()]
    assert lines == ["mcore-autopatch=mcore_autopatch.cli:main"]


def test_startup_file_contents_are_pinned(wheel_path):
    """The .pth is one guarded line; the .start names the same idempotent callable."""
    with zipfile.ZipFile(wheel_path) as zf:
        assert zf.read("mcore_autopatch.pth").decode("utf-8") == PTH_CONTENT
        assert zf.read("mcore_autopatch.start").decode("utf-8") == START_CONTENT
    for name, content in zip(STARTUP_FILES, (PTH_CONTENT, START_CONTENT)):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            assert f.read() == content
    assert PTH_CONTENT.count("\n") == 1  # site runs a .pth line by line: it must stay one line


# --- pip install / uninstall -----------------------------------------------------------


@pytest.fixture
def pip_venv(tmp_path) -> str:
    return make_pip_venv(str(tmp_path / "venv"))


def test_start_entry_point_resolves_to_activate_and_installs_one_finder(pip_venv, wheel_path, tmp_path):
    """PEP 829 (Python 3.15+) runs the .start callable instead of the .pth line; it must be
    ``activate`` and idempotent. Run under -S so no .pth has run before."""
    pip(pip_venv, "install", "-q", wheel_path)
    sp = site_packages(pip_venv)
    code = "\n".join(
        [
            "import pkgutil, sys",
            "sys.path.append(%r)" % sp,
            "before = %s" % COUNT_FINDERS,
            "line = open(%r).read().strip()" % os.path.join(sp, "mcore_autopatch.start"),
            "target = pkgutil.resolve_name(line)",
            "import mcore_autopatch",
            "assert target is mcore_autopatch.activate, target",
            "results = [target(), target()]",
            "print(before, results, %s)" % COUNT_FINDERS,
        ]
    )
    proc = run_python(pip_venv, ["-S", "-c", code], clean_env(), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "[True,", "True]", "1"]


def test_pip_install_puts_startup_files_in_site_packages_and_uninstall_removes_them(pip_venv, wheel_path, tmp_path):
    """After ``pip uninstall`` no .pth is left behind to run at every start (pytest-cov #53)."""
    sp = site_packages(pip_venv)
    bin_dir = os.path.dirname(pip_venv)
    assert our_files(sp) == []
    pip(pip_venv, "install", "-q", wheel_path)
    assert {"mcore_autopatch", *STARTUP_FILES} <= set(our_files(sp))
    for name, content in zip(STARTUP_FILES, (PTH_CONTENT, START_CONTENT)):
        with open(os.path.join(sp, name), encoding="utf-8") as f:
            assert f.read() == content
    assert finder_count(pip_venv, str(tmp_path)) == 1
    status = run_python(os.path.join(bin_dir, "mcore-autopatch"), ["status", "--json"], clean_env(), cwd=str(tmp_path))
    info = json.loads(status.stdout)
    assert info["hook_installed"] is True and info["startup_file"] == os.path.join(sp, "mcore_autopatch.pth")

    pip(pip_venv, "uninstall", "-y", "mcore-autopatch")
    assert our_files(sp) == []
    assert not os.path.exists(os.path.join(bin_dir, "mcore-autopatch"))
    assert finder_count(pip_venv, str(tmp_path)) == 0


def test_editable_install_carries_the_startup_hook_and_uninstall_removes_it(pip_venv, tmp_path):
    """``pip install -e .``: setup.py adds the startup files to the editable wheel too."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, str(src / name), ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, str(src))
    sp = site_packages(pip_venv)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip(pip_venv, "install", "-q", "-e", str(src), cwd=str(elsewhere))
    files = our_files(sp)
    assert set(STARTUP_FILES) <= set(files), files
    assert "mcore_autopatch" not in files  # editable: the code stays in the source folder
    with open(os.path.join(sp, "mcore_autopatch.pth"), encoding="utf-8") as f:
        assert f.read() == PTH_CONTENT
    where = run_python(
        pip_venv, ["-c", "import mcore_autopatch; print(mcore_autopatch.__file__)"], clean_env(), cwd=str(elsewhere)
    )
    assert where.stdout.strip() == str(src / "mcore_autopatch" / "__init__.py")
    assert finder_count(pip_venv, str(elsewhere)) == 1

    pip(pip_venv, "uninstall", "-y", "mcore-autopatch")
    assert our_files(sp) == []
    assert finder_count(pip_venv, str(elsewhere)) == 0
