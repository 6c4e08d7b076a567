"""The wheel, and what pip makes of it: the startup files travel, install and uninstall.

A ``.pth`` must sit at the top of site-packages, outside any package, so setup.py carries
``mcore_autopatch.pth`` and ``mcore_autopatch.start`` at the wheel root (and into editable
wheels). These tests read the built wheel, then install it with pip into small venvs
without torch, the way a user would, and check that ``pip uninstall`` leaves nothing behind.

The release side: ``python -m build`` on a clean copy of the checkout makes an sdist that
carries everything a build needs, and a wheel built from that sdist equal to the one built
from the tree; wheel builds are byte-reproducible (``make wheel`` prints the sha256 to pin);
the Apache-2.0 LICENSE ships in the metadata. Other installers: tests/test_installers.py.
"""

import csv
import email.parser
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from typing import Dict, List, Optional

import pytest
from conftest import ROOT, checkout_for_make, clean_env, envs, run_python
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


def pip(
    python: str, *args: str, cwd: "str | None" = None, env: "Dict[str, str] | None" = None
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env or clean_env(),
    )
    assert proc.returncode == 0, "pip %s failed:\n%s\n%s" % (" ".join(args), proc.stdout, proc.stderr[-4000:])
    return proc


def site_packages(python: str) -> str:
    proc = run_python(python, ["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], clean_env())
    return proc.stdout.strip()


def finder_count(python: str, cwd: str, env: "Dict[str, str] | None" = None, flags: "List[str] | None" = None) -> int:
    proc = run_python(
        python, [*(flags or []), "-c", "import sys; print(%s)" % COUNT_FINDERS], env or clean_env(), cwd=cwd
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return int(proc.stdout)


def our_files(folder: str) -> List[str]:
    """Our files in a site-packages folder (none when an uninstall has removed the folder itself)."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if "mcore_autopatch" in n or n.startswith("__editable__"))


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def wheel_members(wheel: str) -> Dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def recorded(wheel: str) -> List[str]:
    return [row[0] for row in csv.reader(io.StringIO(wheel_text(wheel, ".dist-info/RECORD"))) if row]


# --- building: python -m build, reproducible wheels ------------------------------------

TOOLS_PYTHON = envs.venv_python(envs.TOOLS)  # pytest, build, setuptools, wheel
# What `git clone` of this checkout would not hold (.gitignore), for a checkout without git.
NOT_IN_A_CLONE = (".git", ".cache", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".*_cache")


def clean_checkout(dest: str) -> str:
    """A copy of what a clean clone of this checkout holds: the files git tracks, plus new
    ones it does not ignore (so uncommitted work is tested too); nothing built or cached."""
    proc = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:  # not a git checkout (or no git): copy without what .gitignore names
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*NOT_IN_A_CLONE))
        return dest
    for name in filter(None, proc.stdout.split("\0")):
        path = os.path.join(ROOT, name)
        if os.path.isfile(path):  # a tracked file deleted in the working tree is not copied
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(path, os.path.join(dest, name))
    return dest


def python_m_build(folder: str, *args: str, src: "str | None" = None) -> subprocess.CompletedProcess:
    """``python -m build ARGS`` of a clean checkout copy, isolated: setuptools and wheel come
    from the registry, as for any user who builds a release (or pip installing the sdist)."""
    src = src or clean_checkout(os.path.join(folder, "checkout"))
    proc = subprocess.run(
        [TOOLS_PYTHON, "-m", "build", *args, "--outdir", os.path.join(folder, "dist"), src],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert proc.returncode == 0, "python -m build %s failed:\n%s\n%s" % (
        " ".join(args),
        proc.stdout[-4000:],
        proc.stderr[-4000:],
    )
    return proc


def built(folder: str, pattern: str) -> str:
    (path,) = glob.glob(os.path.join(folder, "dist", pattern))
    return path


@pytest.fixture(scope="session")
def release_build(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    """``python -m build`` (sdist, then the wheel built from the sdist), and the wheel built
    straight from the same tree with the same isolated build tools."""
    folder = str(tmp_path_factory.mktemp("release"))
    proc = python_m_build(folder)
    tree = os.path.join(folder, "tree")
    python_m_build(tree, "--wheel", src=os.path.join(folder, "checkout"))
    return {
        "log": proc.stdout,
        "sdist": built(folder, "mcore_autopatch-*.tar.gz"),
        "wheel": built(folder, "mcore_autopatch-*.whl"),
        "tree_wheel": built(tree, "mcore_autopatch-*.whl"),
    }


def build_wheel_from_a_copy(folder: str, mtime: float, mode: int, umask: int, epoch: Optional[str]) -> str:
    """Build the wheel (as ``make wheel`` does) from a fresh copy of the sources whose files
    all get ``mtime`` and ``mode``, under ``umask``, with SOURCE_DATE_EPOCH=``epoch`` (None: unset)."""
    src = envs.copy_sources(os.path.join(folder, "src"))
    for parent, _dirs, files in os.walk(src):
        for name in files:
            os.chmod(os.path.join(parent, name), mode)
            os.utime(os.path.join(parent, name), (mtime, mtime))
    proc = subprocess.run(
        [TOOLS_PYTHON, "-m", "build", "--wheel", "--no-isolation", "--outdir", os.path.join(folder, "dist"), src],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(SOURCE_DATE_EPOCH=epoch),
        umask=umask,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return built(folder, "mcore_autopatch-*.whl")


def member_times_and_modes(wheel: str) -> Dict[str, object]:
    with zipfile.ZipFile(wheel) as zf:
        return {i.filename: (i.date_time, i.external_attr >> 16 & 0o777) for i in zf.infolist()}


# --- the wheel itself ------------------------------------------------------------------


def package_files() -> List[str]:
    """Every file of the package in this checkout (its subpackages too), as a wheel names it."""
    found = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, "mcore_autopatch")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        relative = os.path.relpath(folder, ROOT)
        found += ["%s/%s" % (relative, n) for n in files if n.endswith((".py", ".typed"))]
    return found


def test_wheel_root_carries_pth_and_start_and_record_lists_them(wheel_path):
    """pip only installs (and uninstall only removes) files the wheel holds and RECORD lists."""
    names = wheel_names(wheel_path)
    for name in (*STARTUP_FILES, "mcore_autopatch/py.typed", "mcore_autopatch/__init__.py"):
        assert name in names


def test_wheel_carries_every_file_of_the_package_and_its_subpackages(wheel_path):
    """setup.cfg lists the subpackages (fixes, shared, cli): a missing one imports nowhere."""
    names = wheel_names(wheel_path)
    assert sorted(n for n in names if n.startswith("mcore_autopatch/")) == sorted(package_files())
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


# Of https://www.apache.org/licenses/LICENSE-2.0.txt (also Debian's common-licenses/Apache-2.0).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_is_the_apache_2_0_text_and_ships_in_the_wheel_metadata_as_license_file(wheel_path: str) -> None:
    """setup.cfg says Apache-2.0: the full text is at the top and in .dist-info, named by License-File."""
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        text = f.read()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256
    metadata = email.parser.Parser().parsestr(wheel_text(wheel_path, ".dist-info/METADATA"))
    assert metadata["License"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    # Metadata 2.4 (PEP 639) keeps license files in .dist-info/licenses/; older setuptools in .dist-info/.
    (shipped,) = [n for n in wheel_names(wheel_path) if n.endswith("/LICENSE")]
    assert re.fullmatch(r"mcore_autopatch-[^/]+\.dist-info/(licenses/)?LICENSE", shipped), shipped
    with zipfile.ZipFile(wheel_path) as zf:
        assert zf.read(shipped) == text
    assert shipped in recorded(wheel_path)


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
    envs.copy_sources(str(src))
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


# --- python -m build: the sdist and the wheel built from it ----------------------------


def test_python_m_build_on_a_clean_checkout_makes_the_sdist_and_a_wheel_from_it(release_build: Dict[str, str]) -> None:
    """The release command: isolated build, sdist first, then the wheel built from the sdist."""
    last = release_build["log"].strip().splitlines()[-1]
    names = (os.path.basename(release_build["sdist"]), os.path.basename(release_build["wheel"]))
    assert last == "Successfully built %s and %s" % names


def test_sdist_carries_the_startup_files_license_and_only_what_a_build_needs(release_build: Dict[str, str]) -> None:
    """Without the .pth and .start in the sdist, building (or pip installing) from it fails."""
    with tarfile.open(release_build["sdist"]) as tf:
        members = {m.name.split("/", 1)[1]: m for m in tf.getmembers() if m.isfile()}
        read = {name: tf.extractfile(m).read() for name, m in members.items()}  # type: ignore[union-attr]
    package = sorted(package_files())
    build_inputs = ["LICENSE", "MANIFEST.in", "PKG-INFO", "README.md", "pyproject.toml", "setup.cfg", "setup.py"]
    expected = {*build_inputs, *STARTUP_FILES, *package}
    assert {n for n in members if not n.startswith("mcore_autopatch.egg-info/")} == expected
    assert read["mcore_autopatch.pth"].decode("utf-8") == PTH_CONTENT
    assert read["mcore_autopatch.start"].decode("utf-8") == START_CONTENT
    for name in ("LICENSE", "setup.py", "pyproject.toml", "MANIFEST.in"):  # setuptools rewrites setup.cfg
        with open(os.path.join(ROOT, name), "rb") as f:
            assert read[name] == f.read(), name


def test_wheel_built_from_the_sdist_equals_the_wheel_built_from_the_tree(release_build: Dict[str, str]) -> None:
    """Same members, same bytes (startup files at the root and in RECORD), same sha256."""
    from_sdist, from_tree = wheel_members(release_build["wheel"]), wheel_members(release_build["tree_wheel"])
    assert sorted(from_sdist) == sorted(from_tree)
    assert [n for n in from_sdist if from_sdist[n] != from_tree[n]] == []
    for name in STARTUP_FILES:
        assert name in from_sdist and name in recorded(release_build["wheel"])
    assert sha256(release_build["wheel"]) == sha256(release_build["tree_wheel"])


# --- reproducible wheels ---------------------------------------------------------------

# Two checkouts of one commit: different file times (clone date) and modes (umask).
CHECKOUT_A = {"mtime": 1_000_000_000.0, "mode": 0o644, "umask": 0o022}
CHECKOUT_B = {"mtime": 1_600_000_000.5, "mode": 0o664, "umask": 0o002}


def test_two_wheel_builds_with_the_same_source_date_epoch_are_byte_identical(tmp_path) -> None:
    """SOURCE_DATE_EPOCH sets every member's time; modes are normalised whatever the umask."""
    epoch = "1700000000"
    a = build_wheel_from_a_copy(str(tmp_path / "a"), epoch=epoch, **CHECKOUT_A)  # type: ignore[arg-type]
    b = build_wheel_from_a_copy(str(tmp_path / "b"), epoch=epoch, **CHECKOUT_B)  # type: ignore[arg-type]
    assert sha256(a) == sha256(b)
    when = time.gmtime(int(epoch))[:6]
    for name, (date_time, mode) in member_times_and_modes(a).items():
        assert date_time == when, name
        assert name.endswith("/RECORD") or mode == 0o644, (name, oct(mode))


def test_two_wheel_builds_without_source_date_epoch_are_byte_identical(tmp_path) -> None:
    """Unset, setup.py uses a fixed time (1980-01-01), so a plain `make wheel` is reproducible too."""
    a = build_wheel_from_a_copy(str(tmp_path / "a"), epoch=None, **CHECKOUT_A)  # type: ignore[arg-type]
    b = build_wheel_from_a_copy(str(tmp_path / "b"), epoch=None, **CHECKOUT_B)  # type: ignore[arg-type]
    assert sha256(a) == sha256(b)
    assert {dt for dt, _mode in member_times_and_modes(a).values()} == {(1980, 1, 1, 0, 0, 0)}


def make_wheel(work: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "wheel"], cwd=work, capture_output=True, text=True, timeout=300, env=clean_env(SOURCE_DATE_EPOCH=None)
    )


def assert_path_and_sha256_only(proc: subprocess.CompletedProcess, work: str) -> str:
    """stdout is exactly two lines: the wheel's path, then ``sha256sum`` of it."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, "make wheel's stdout must hold only the path and the hash:\n%s" % proc.stdout
    path_line, sum_line = lines
    assert os.path.dirname(path_line) == os.path.join(work, "dist")
    assert sum_line == "%s  %s" % (sha256(path_line), path_line)
    return sum_line.split()[0]


def test_make_wheel_prints_the_wheel_and_its_sha256_the_same_for_two_builds(tmp_path) -> None:
    """`make wheel` in a copy of the checkout: path, then ``sha256sum`` of it; rebuilt after
    touching every source, the hash does not change."""
    work = checkout_for_make(tmp_path / "checkout")
    printed = []
    for mtime in (1_000_000_000, 1_700_000_000):
        for parent, _dirs, files in os.walk(os.path.join(work, "mcore_autopatch")):
            for name in files:
                os.utime(os.path.join(parent, name), (mtime, mtime))
        proc = make_wheel(work)
        printed.append(assert_path_and_sha256_only(proc, work))
        os.remove(proc.stdout.splitlines()[0])
    assert printed[0] == printed[1]


def test_make_wheel_prints_only_the_path_and_hash_when_the_build_is_slow(tmp_path) -> None:
    """A build that takes seconds (a busy CI runner, a slow disk) by construction: this copy's
    setup.py sleeps first. tools/envs.py then says how long the target took, and that line
    goes to stderr, never into the path make reads from stdout."""
    work = checkout_for_make(tmp_path / "checkout")
    setup = os.path.join(work, "setup.py")
    with open(setup) as f:
        text = f.read()
    with open(setup, "w") as f:
        f.write("import time\ntime.sleep(1.5)  # test: a slow build\n" + text)
    proc = make_wheel(work)
    assert_path_and_sha256_only(proc, work)
    assert re.search(r"^\[envs\] wheel ready in \d+ s$", proc.stderr, re.M), proc.stderr


def test_make_wheel_says_why_when_the_build_fails_and_prints_nothing(tmp_path) -> None:
    work = checkout_for_make(tmp_path / "checkout")
    with open(os.path.join(work, "setup.py"), "a") as f:
        f.write("\nraise SystemExit('test: this build fails')\n")
    proc = make_wheel(work)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "test: this build fails" in proc.stderr
    assert "building the wheel failed" in proc.stderr
    assert not glob.glob(os.path.join(work, "dist", "*.whl"))
