"""Every installer an image is built with: the startup hook is active afterwards, and the
matching uninstall leaves no mcore_autopatch file in site-packages and no finder.

Each case runs the real installer in a subprocess, into a throwaway venv or folder under
tmp_path: pip from the sdist (built by ``python -m build``; pip's build isolation fetches
setuptools from the registry), ``pip install --user`` (a pyenv CPython with PYTHONUSERBASE
in tmp_path, never the real user site), ``uv pip install`` (uv from the tools venv),
``pip install --require-hashes`` with the wheel's sha256 (and a wrong hash refused), the
hash-pinned install step of examples/Dockerfile run as docker runs it, and ``uv pip install
--target``, which cannot carry the hook, so ``status`` says so. The plain wheel and the
editable install are in tests/test_packaging.py.
"""

import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

import pytest
from conftest import ROOT, clean_env, envs, run_python
from test_packaging import (
    PTH_CONTENT,
    STARTUP_FILES,
    built,
    finder_count,
    make_pip_venv,
    our_files,
    pip,
    python_m_build,
    sha256,
    site_packages,
)

UV = os.path.join(envs.TOOLS, "bin", "uv")


def base_python() -> str:
    """The CPython the tools venv was made from (pyenv's 3.11 here): not a venv, so it has a user site."""
    found = envs.find_python("%d.%d" % sys.version_info[:2])
    return found or getattr(sys, "_base_executable", sys.executable)


def status_json(console_script: str, cwd: str, env: Optional[Dict[str, str]] = None) -> Dict[str, object]:
    proc = run_python(console_script, ["status", "--json"], env or clean_env(), cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_hook_active(python: str, sp: str, cwd: str, env: Optional[Dict[str, str]] = None) -> None:
    """Both startup files in ``sp``, one finder at startup, and ``status`` naming our .pth."""
    assert {"mcore_autopatch", *STARTUP_FILES} <= set(our_files(sp)), our_files(sp)
    with open(os.path.join(sp, "mcore_autopatch.pth"), encoding="utf-8") as f:
        assert f.read() == PTH_CONTENT
    assert finder_count(python, cwd, env) == 1
    info = status_json(os.path.join(os.path.dirname(python), "mcore-autopatch"), cwd, env)
    pth = os.path.join(sp, "mcore_autopatch.pth")
    assert info["hook_installed"] is True
    assert info["startup_file"] == pth and info["installed_by"] == pth


def assert_removed(python: str, sp: str, cwd: str, env: Optional[Dict[str, str]] = None) -> None:
    assert our_files(sp) == []
    assert not os.path.exists(os.path.join(os.path.dirname(python), "mcore-autopatch"))
    assert finder_count(python, cwd, env) == 0


def run_tool(args: List[str], env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env or clean_env(), cwd=cwd)
    assert proc.returncode == 0, "%s failed:\n%s\n%s" % (" ".join(args), proc.stdout, proc.stderr[-4000:])
    return proc.stdout + proc.stderr


@pytest.fixture
def pip_venv(tmp_path) -> str:
    return make_pip_venv(str(tmp_path / "venv"))


@pytest.fixture(scope="session")
def sdist_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The sdist ``python -m build --sdist`` makes of a clean copy of this checkout."""
    folder = str(tmp_path_factory.mktemp("sdist"))
    python_m_build(folder, "--sdist")
    return built(folder, "mcore_autopatch-*.tar.gz")


@pytest.fixture
def uv() -> str:
    if not os.access(UV, os.X_OK):
        pytest.skip("uv missing from the tools venv: run `make test-env` (or `python3 tools/envs.py tools`)")
    return UV


def uv_venv(uv: str, folder: str) -> str:
    """``uv venv``: a venv without pip, as uv users make them."""
    run_tool([uv, "venv", "-q", "--python", base_python(), folder])
    return os.path.join(folder, "bin", "python")


# --- pip ---------------------------------------------------------------------------------


def test_pip_install_of_the_sdist_activates_the_hook_and_uninstall_removes_it(pip_venv, sdist_path, tmp_path) -> None:
    """pip builds the wheel from the sdist (setuptools from the registry), then installs it."""
    sp = site_packages(pip_venv)
    pip(pip_venv, "install", "-q", sdist_path)
    assert_hook_active(pip_venv, sp, str(tmp_path))
    pip(pip_venv, "uninstall", "-y", "mcore-autopatch")
    assert_removed(pip_venv, sp, str(tmp_path))


def test_pip_install_user_activates_the_hook_from_the_user_site_and_uninstall_removes_it(
    wheel_path: str, tmp_path
) -> None:
    """``pip install --user``: the user site is processed at startup like site-packages (not under -s)."""
    python = base_python()
    if our_files(site_packages(python)):
        pytest.skip("%s already has mcore_autopatch in its own site-packages" % python)
    env = clean_env(PYTHONUSERBASE=str(tmp_path / "userbase"))
    where = run_python(python, ["-c", "import site; print(site.ENABLE_USER_SITE, site.getusersitepackages())"], env)
    enabled, user_site = where.stdout.split()
    assert enabled == "True" and user_site.startswith(str(tmp_path / "userbase") + os.sep), where.stdout
    scripts = str(tmp_path / "userbase" / "bin")

    pip(python, "install", "-q", "--user", "--no-warn-script-location", wheel_path, env=env)
    assert {"mcore_autopatch", *STARTUP_FILES} <= set(our_files(user_site))
    assert finder_count(python, str(tmp_path), env) == 1
    assert finder_count(python, str(tmp_path), env, flags=["-s"]) == 0  # -s: no user site, no hook
    info = status_json(os.path.join(scripts, "mcore-autopatch"), str(tmp_path), env)
    pth = os.path.join(user_site, "mcore_autopatch.pth")
    assert info["hook_installed"] is True and info["startup_file"] == pth and info["installed_by"] == pth

    pip(python, "uninstall", "-y", "mcore-autopatch", env=env)
    assert our_files(user_site) == []
    assert not os.path.exists(os.path.join(scripts, "mcore-autopatch"))
    assert finder_count(python, str(tmp_path), env) == 0


def requirements_file(folder: str, wheel: str, digest: str) -> str:
    path = os.path.join(folder, "requirements.txt")
    with open(path, "w") as f:
        f.write("%s --hash=sha256:%s\n" % (wheel, digest))
    return path


def test_pip_require_hashes_installs_the_wheel_pinned_by_its_sha256_and_uninstall_removes_it(
    pip_venv, wheel_path: str, tmp_path
) -> None:
    """The image recipe: packaging is already there (torch images have it); the wheel is pinned."""
    sp = site_packages(pip_venv)
    pip(pip_venv, "install", "-q", "packaging")
    pip(
        pip_venv,
        "install",
        "-q",
        "--require-hashes",
        "-r",
        requirements_file(str(tmp_path), wheel_path, sha256(wheel_path)),
    )
    assert_hook_active(pip_venv, sp, str(tmp_path))
    pip(pip_venv, "uninstall", "-y", "mcore-autopatch")
    assert_removed(pip_venv, sp, str(tmp_path))


def test_pip_require_hashes_refuses_the_wheel_with_a_wrong_sha256_and_installs_nothing(
    pip_venv, wheel_path: str, tmp_path
) -> None:
    digest = sha256(wheel_path)
    wrong = ("0" if digest[0] != "0" else "1") + digest[1:]
    sp = site_packages(pip_venv)
    pip(pip_venv, "install", "-q", "packaging")
    proc = subprocess.run(
        [
            pip_venv,
            "-m",
            "pip",
            "install",
            "--require-hashes",
            "-r",
            requirements_file(str(tmp_path), wheel_path, wrong),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert proc.returncode != 0
    assert "DO NOT MATCH THE HASHES" in proc.stderr and digest in proc.stderr, proc.stderr
    assert_removed(pip_venv, sp, str(tmp_path))


def dockerfile_run(containing: str) -> str:
    """The shell command of examples/Dockerfile's RUN instruction that contains ``containing``,
    continuation lines joined as docker joins them."""
    with open(os.path.join(ROOT, "examples", "Dockerfile"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    commands: List[str] = []
    current: Optional[List[str]] = None
    for line in lines:
        if current is None and line.startswith("RUN "):
            current = [line[len("RUN ") :]]
        elif current is not None and not line.lstrip().startswith("#"):
            current.append(line)
        if current is not None and not current[-1].endswith("\\"):
            commands.append(" ".join(part.rstrip("\\").strip() for part in current))
            current = None
    (found,) = [c for c in commands if containing in c]
    return found


@pytest.mark.parametrize("right_hash", [True, False], ids=["right-hash", "wrong-hash"])
def test_dockerfile_hash_pinned_install_step_installs_the_wheel_or_refuses_a_wrong_hash(
    pip_venv, wheel_path: str, tmp_path, right_hash: bool
) -> None:
    """examples/Dockerfile's install RUN, run by sh as docker would (ARGs are its environment;
    the image's /tmp/mcore-autopatch is a folder here), against a venv that has packaging."""
    command = dockerfile_run("--require-hashes")
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy2(wheel_path, str(context))
    command = command.replace("/tmp/mcore-autopatch", str(context))
    digest = sha256(wheel_path) if right_hash else "0" * 64
    sp = site_packages(pip_venv)
    pip(pip_venv, "install", "-q", "packaging")
    env = clean_env(PYTHON=pip_venv, WHEEL_SHA256=digest)
    proc = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path)
    )
    if right_hash:
        assert proc.returncode == 0, proc.stderr
        assert_hook_active(pip_venv, sp, str(tmp_path))
        assert not context.exists()  # the RUN cleans up after itself
    else:
        assert proc.returncode != 0 and "DO NOT MATCH THE HASHES" in proc.stderr, proc.stderr
        assert_removed(pip_venv, sp, str(tmp_path))
    no_hash = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, env=clean_env(PYTHON=pip_venv, WHEEL_SHA256="")
    )
    assert no_hash.returncode == 1 and "--build-arg WHEEL_SHA256=" in no_hash.stderr


# --- uv ----------------------------------------------------------------------------------


def test_uv_pip_install_activates_the_hook_and_uv_pip_uninstall_removes_it(uv: str, wheel_path: str, tmp_path) -> None:
    """uv installs from the wheel's RECORD like pip; `packaging` comes from uv's default index."""
    python = uv_venv(uv, str(tmp_path / "venv"))
    sp = site_packages(python)
    run_tool([uv, "pip", "install", "--python", python, wheel_path], cwd=str(tmp_path))
    assert_hook_active(python, sp, str(tmp_path))
    run_tool([uv, "pip", "uninstall", "--python", python, "mcore-autopatch"], cwd=str(tmp_path))
    assert_removed(python, sp, str(tmp_path))


def test_uv_pip_install_target_cannot_carry_the_hook_and_status_says_not_processed(
    uv: str, wheel_path: str, tmp_path
) -> None:
    """``--target DIR``: the .pth lands in DIR, which Python never scans; status says so."""
    python = uv_venv(uv, str(tmp_path / "venv"))
    target = str(tmp_path / "libs")
    run_tool([uv, "pip", "install", "--python", python, "--target", target, wheel_path], cwd=str(tmp_path))
    assert set(STARTUP_FILES) <= set(our_files(target))
    env = clean_env(PYTHONPATH=target)
    assert finder_count(python, str(tmp_path), env) == 0
    proc = run_python(python, ["-m", "mcore_autopatch", "status", "--json"], env, cwd=str(tmp_path))
    info = json.loads(proc.stdout)
    assert info["hook_installed"] is False
    assert info["startup_file"] == os.path.join(target, "mcore_autopatch.pth")
    assert info["startup_file_processed"] is False
    text = run_python(python, ["-m", "mcore_autopatch", "status"], env, cwd=str(tmp_path)).stdout
    assert "NOT processed at startup" in text, text
