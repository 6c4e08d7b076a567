"""Build the cached environments that `make demo`, `make test` and `make bench` use.

Standard library only; run with any Python 3.8+:

    python3 tools/envs.py tools e2e mcore pythons   # what `make test` needs
    python3 tools/envs.py demo                      # .venv for `make demo`
    python3 tools/envs.py wheel                     # dist/*.whl, built from this checkout

Everything lands in ignored folders (.cache/, .venv/, dist/). Each environment gets a
stamp file naming what was installed; a second run with the same spec does nothing, so a
repeated `make test` starts in seconds. torch is always 2.13.0 (the CPU wheel that lies on
these machines); megatron-core is installed with --no-deps, beside numpy, psutil and
packaging, which is all its checkpointing code needs.
"""

import glob
import os
import shutil
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache")
TOOLS = os.path.join(CACHE, "tools")
E2E = os.path.join(CACHE, "e2e-venv")
MCORE = os.path.join(CACHE, "mcore")
PYTHONS = os.path.join(CACHE, "pythons")
DEMO = os.path.join(ROOT, ".venv")
DIST = os.path.join(ROOT, "dist")

TORCH = "torch==2.13.0"
MEGATRON_DEPS = ["numpy", "psutil", "packaging"]
TOOL_REQUIREMENTS = [
    "pytest==9.2.0",
    "pytest-xdist==3.8.0",
    "pytest-timeout==2.4.0",
    "ruff==0.17.6",
    "build==1.6.1",
    "setuptools==84.2.1",
    "wheel==0.48.0",
    "packaging",
    "uv==0.13.9",  # tests/test_installers.py: `uv venv` and `uv pip install` of the wheel
]
# Every megatron-core release the tests use: the affected range, the fixed releases, and
# newer ones that are only imported (their save path needs CUDA).
MEGATRON_VERSIONS = [
    "0.9.0",
    "0.10.0",
    "0.11.0",
    "0.12.0",
    "0.12.1",
    "0.12.2",
    "0.12.3",
    "0.13.0",
    "0.13.1",
    "0.14.0",
    "0.15.3",
    "0.16.1",
]
# Other CPython minors (installed through pyenv here, without torch) for the startup tests.
OTHER_PYTHONS = ["3.8", "3.9", "3.10", "3.12", "3.13"]


def log(message: str) -> None:
    print("[envs] %s" % message, flush=True)


def run(*cmd: str, **kwargs: object) -> None:
    subprocess.run(list(cmd), check=True, **kwargs)  # type: ignore[call-overload]


# Variables that would steer a child Python or a child rank: tests and benchmarks start
# every child without them, then set what the case needs.
STEERING_PREFIXES = (
    "MCORE_AUTOPATCH",
    "PYTHON",
    "VIRTUAL_ENV",
    "PYTEST",
    "RANK",
    "WORLD_SIZE",
    "MASTER_",
    "LOCAL_RANK",
    "COV_",
)


def child_env(**extra: "str | None") -> "dict[str, str]":
    """This process's environment without steering variables, plus ``extra`` (None removes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(STEERING_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def site_packages(python: str) -> str:
    """The purelib folder of the interpreter ``python``."""
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def venv_python(folder: str) -> str:
    return os.path.join(folder, "bin", "python")


def _ready(folder: str, spec: str) -> bool:
    try:
        with open(os.path.join(folder, ".envs-stamp")) as f:
            return f.read() == spec
    except OSError:
        return False


def _stamp(folder: str, spec: str) -> None:
    with open(os.path.join(folder, ".envs-stamp"), "w") as f:
        f.write(spec)


def make_venv(folder: str, packages: "list[str]", python: "str | None" = None, label: str = "") -> str:
    """A venv at ``folder`` with ``packages``; reused while its stamp matches."""
    spec = "%s|%s" % (python or "default", " ".join(packages))
    if _ready(folder, spec):
        return venv_python(folder)
    log("creating %s %s" % (os.path.relpath(folder, ROOT), label))
    shutil.rmtree(folder, ignore_errors=True)
    if python is None:
        venv.EnvBuilder(with_pip=True).create(folder)
    else:
        run(python, "-m", "venv", folder)
    py = venv_python(folder)
    if packages:
        run(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages)
    _stamp(folder, spec)
    return py


def tools() -> str:
    return make_venv(TOOLS, TOOL_REQUIREMENTS, label="(pytest, ruff, build)")


def e2e() -> str:
    return make_venv(E2E, [TORCH, *MEGATRON_DEPS], label="(torch 2.13.0, numpy, psutil, packaging)")


def mcore_folder(version: str) -> str:
    return os.path.join(MCORE, version)


def mcore(versions: "list[str]" = MEGATRON_VERSIONS) -> None:
    py = e2e()
    for version in versions:
        folder = mcore_folder(version)
        spec = "megatron-core==%s" % version
        if _ready(folder, spec):
            continue
        log("installing megatron-core %s into %s" % (version, os.path.relpath(folder, ROOT)))
        shutil.rmtree(folder, ignore_errors=True)
        run(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target", folder, spec)
        _stamp(folder, spec)


def find_python(minor: str) -> "str | None":
    """The pyenv CPython for ``minor`` ("3.8"), or one on PATH."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for candidate in sorted(
        glob.glob(os.path.join(root, "versions", minor + ".*", "bin", "python" + minor)), reverse=True
    ):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("python" + minor)
    return found


def python_venv_folder(minor: str) -> str:
    return os.path.join(PYTHONS, minor)


def pythons() -> None:
    """One small venv per other CPython minor, with packaging (our runtime dependency)."""
    for minor in OTHER_PYTHONS:
        python = find_python(minor)
        if python is None:
            log("CPython %s not found; its startup tests will be skipped" % minor)
            continue
        packages = ["packaging"] + (["importlib-metadata"] if minor in ("3.8", "3.9") else [])
        make_venv(python_venv_folder(minor), packages, python=python, label="(CPython %s)" % minor)


# What the wheel is built from: copied to a temporary folder first, so that concurrent
# builds never share a build/ folder and no stale build/lib file can ship.
SOURCES = [
    "mcore_autopatch",
    "setup.py",
    "setup.cfg",
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "MANIFEST.in",
    "mcore_autopatch.pth",
    "mcore_autopatch.start",
]


def copy_sources(dest: str) -> str:
    """Copy ``SOURCES`` of this checkout (no ``__pycache__``) into the new folder ``dest``."""
    os.makedirs(dest)
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(dest, name), ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, dest)
    return dest


def wheel(out: str = DIST) -> str:
    """Build the wheel from this checkout into ``out``; return its path.

    setup.py makes it reproducible (fixed member times unless SOURCE_DATE_EPOCH is set,
    normalised modes), so the same sources and build tools give the same sha256.
    """
    import tempfile

    py = venv_python(TOOLS) if os.path.exists(venv_python(TOOLS)) else tools()
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mcore-autopatch-build-") as tmp:
        src = copy_sources(os.path.join(tmp, "src"))
        built_dir = os.path.join(tmp, "dist")
        proc = subprocess.run(
            [py, "-m", "build", "--wheel", "--no-isolation", "--outdir", built_dir, src], capture_output=True, text=True
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit("building the wheel failed")
        (built,) = glob.glob(os.path.join(built_dir, "mcore_autopatch-*.whl"))
        target = os.path.join(out, os.path.basename(built))
        shutil.move(built, target)
    return target


def clone_venv(source: str, target: str) -> str:
    """A copy of the venv at ``source`` made of hard links (a second or two for torch).

    Nothing installs into or deletes from the source through the clone: pip and Python
    only add, replace or unlink files, and directories are the clone's own.
    """
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    run("cp", "-al", source, target)
    stamp = os.path.join(target, ".envs-stamp")
    if os.path.exists(stamp):
        os.remove(stamp)
    return venv_python(target)


def demo() -> str:
    return make_venv(
        DEMO,
        [TORCH, *MEGATRON_DEPS],
        label="(torch 2.13.0; megatron-core 0.12.1 next)",
    )


def demo_megatron() -> None:
    py = demo()
    spec = "megatron-core==0.12.1"
    marker = os.path.join(DEMO, ".envs-megatron")
    if os.path.exists(marker):
        return
    log("installing megatron-core 0.12.1 (--no-deps) into .venv")
    run(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", spec)
    open(marker, "w").close()


TARGETS = {
    "tools": tools,
    "e2e": e2e,
    "mcore": mcore,
    "pythons": pythons,
    "wheel": lambda: print(wheel()),
    "demo": demo_megatron,
}


def main(argv: "list[str]") -> int:
    names = argv or ["tools", "e2e", "mcore", "pythons"]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        print("unknown target(s): %s; choose from %s" % (", ".join(unknown), ", ".join(TARGETS)), file=sys.stderr)
        return 2
    for name in names:
        TARGETS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
