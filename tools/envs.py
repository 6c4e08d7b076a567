"""Build the cached environments that `make demo`, `make test` and `make bench` use.

Standard library only; run with any Python 3.8+:

    python3 tools/envs.py everyday                  # what `make test` needs (about 1.5 GB)
    python3 tools/envs.py                           # everything, for `make test-matrix` too
    python3 tools/envs.py tools e2e mcore           # only some of it (see TARGETS)
    python3 tools/envs.py demo                      # .venv for `make demo`
    python3 tools/envs.py wheel                     # dist/*.whl, built from this checkout

Everything lands in ignored folders (.cache/, .venv/, dist/). Each environment gets a
stamp file naming what was installed; a second run with the same spec does nothing, so a
repeated `make test` starts in seconds. What is built:

* e2e: a venv with torch 2.13.0 (the CPU wheel that lies on these machines);
* torch: one venv per real torch release of TORCH_MATRIX (CUDA builds from the registry,
  with their nvidia-* dependencies; about 1 minute and 4-5 GB each after pruning);
* mcore, nvrx: megatron-core and nvidia-resiliency-ext releases in --no-deps --target
  folders, chosen per run with PYTHONPATH (beside numpy, psutil and packaging, which is all
  their checkpointing code needs);
* seed: torch 2.9.0 with megatron-core 0.12.1 installed into the venv, and Ray;
* fresh: what a fresh image has around megatron-core, on torch 2.9.0, 2.13.0 and 2.15.0: the
  newest numpy 2 (megatron-core 0.6 - 0.12 declare no numpy bound) or numpy 1.26.4, each with
  the newest setuptools (82 removed pkg_resources); hard-link clones of the torch venvs;
* py312: CPython 3.12 (vLLM images' interpreter) with torch 2.9.0 and numpy 2;
* setuptools: setuptools 70.3.0 in a --target folder (its pkg_resources has no packaging);
* tools (pytest, ruff, build, uv) and small venvs for the other CPythons.
"""

import glob
import os
import shutil
import subprocess
import sys
import time
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache")
TOOLS = os.path.join(CACHE, "tools")
E2E = os.path.join(CACHE, "e2e-venv")
MCORE = os.path.join(CACHE, "mcore")
TORCH_VENVS = os.path.join(CACHE, "torch")
SEED = os.path.join(CACHE, "seed-stack")
NVRX = os.path.join(CACHE, "nvrx")
PYTHONS = os.path.join(CACHE, "pythons")
DEMO = os.path.join(ROOT, ".venv")
DIST = os.path.join(ROOT, "dist")

CPU_TORCH_RELEASE = "2.13.0"
TORCH = "torch==%s" % CPU_TORCH_RELEASE
# numpy 1.x: megatron-core declares numpy<2, and its job path (access-integrity validation,
# flattened ranges, the fully parallel exchange) calls np.product, which numpy 2 removed.
MEGATRON_DEPS = ["numpy<2", "psutil", "packaging"]
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
# Real torch releases the matrix also runs on, beside the 2.13.0 CPU wheel of the e2e venv:
# CUDA builds from the registry (with their nvidia-* dependencies; they import and save on
# gloo without a GPU). Each maps to its CUDA line: a release whose line already has a venv
# starts from a hard-link clone of it, so nvidia-* files of the same version are stored once
# and not downloaded again. 2.11.0 is the last release whose FileSystemWriter.finish drops
# megatron-core's mcore_data; 2.15.0, the registry's newest, replaces 2.14.1 (both keep it,
# like 2.13.0) to stay inside the disk and time budgets.
TORCH_MATRIX = {
    "2.6.0": "cu124",
    "2.7.1": "cu126",
    "2.8.0": "cu128",
    "2.9.0": "cu128",
    "2.11.0": "cu130",
    "2.15.0": "cu130",
}
# Releases above this machine's pip constraint (torch<=2.14.1, from /etc/xdg/pip): only the
# pip command that installs one runs with PIP_CONSTRAINT=/dev/null; the machine's
# configuration is never edited.
ABOVE_PIP_CONSTRAINT = {"2.15.0"}
# The seed report's stack (tests/test_e2e_seed_stack.py): megatron-core installed into a
# torch 2.9.0 venv, with Ray.
SEED_TORCH = "2.9.0"
SEED_MEGATRON = "0.12.1"
RAY = "ray==2.60.0"
# nvidia-resiliency-ext: 0.2.1 has no async writer, 0.3.0 makes megatron-core 0.12's old call,
# 0.4.1 reads torch's signature.
NVRX_VERSIONS = ["0.2.1", "0.3.0", "0.4.1"]
# Native serialization_format support: the byte oracle of the tests.
REFERENCE_MEGATRON = "0.13.1"
# Every megatron-core release the tests use: the affected range, the fixed releases, and
# newer ones that are only imported (their save path needs CUDA).
MEGATRON_VERSIONS = [
    "0.6.0",
    "0.7.0",
    "0.8.0",
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
    """Progress for people: stderr. stdout carries only a target's result (the wheel's path)."""
    print("[envs] %s" % message, file=sys.stderr, flush=True)


def folder_size(folder: str, own_only: bool = False) -> int:
    """Bytes under ``folder``, each hard-linked file counted once (as ``du`` does); with
    ``own_only``, only files no other folder shares (a hard-link clone's new files)."""
    seen: "set[tuple[int, int]]" = set()
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen and not (own_only and st.st_nlink > 1):
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def built(folder: str, started: float) -> None:
    """Say what a first build of ``folder`` cost, so a fresh `make test` visibly moves."""
    where, took = os.path.relpath(folder, ROOT), time.time() - started
    size, own = folder_size(folder) / 1e9, folder_size(folder, own_only=True) / 1e9
    log("%s built in %.0f s (%.2f GB, %.2f GB of it its own)" % (where, took, size, own))


def run(*cmd: str, **kwargs: object) -> None:
    subprocess.run(list(cmd), check=True, **kwargs)  # type: ignore[call-overload]


def pip_install(python: str, *args: str, env: "dict[str, str] | None" = None) -> None:
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args, env=env)


# What one pip install of a CUDA torch takes before its unused nvidia libraries are pruned
# (2.8.0: 5.0 GB kept + 1.5 GB pruned), with room for the wheels pip unpacks beside it.
TORCH_INSTALL_PEAK_GB = 8.0


def ensure_free_space(gigabytes: float, what: str) -> None:
    """Stop with a clear message, before pip starts, when the disk of .cache/ has less than
    ``gigabytes`` free: a full disk otherwise shows up as an OSError deep in pip's output."""
    free = shutil.disk_usage(CACHE if os.path.isdir(CACHE) else ROOT).free / 1e9
    if free < gigabytes:
        raise SystemExit(
            "[envs] %s needs about %.0f GB free on the disk of %s; %.1f GB is free. The test "
            "environments take about 26 GB in all (docs/testing.md); free space, or run "
            "`make clean` and try again." % (what, gigabytes, CACHE, free)
        )


def torch_pip_env(release: str) -> "dict[str, str] | None":
    """The environment of the one pip command that installs torch ``release``."""
    if release not in ABOVE_PIP_CONSTRAINT:
        return None
    return dict(os.environ, PIP_CONSTRAINT="/dev/null")


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
    "MAKE",  # MAKEFLAGS, MAKELEVEL: a make run by a test would act as a sub-make of `make test`
    "MFLAGS",
)


def child_env(**extra: "str | None") -> "dict[str, str]":
    """This process's environment without steering variables, plus ``extra`` (None removes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(STEERING_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    # The CUDA torch builds carry triton, so importing megatron-core (which imports
    # torch._inductor through torch.distributed.tensor) warms a pool of compile worker
    # processes, each importing torch again. No checkpoint save compiles anything; on this
    # machine's 2 cores the pool made each job ~40% slower. Tests that want the pool (the
    # seed stack, as a user's image runs it) pass TORCHINDUCTOR_COMPILE_THREADS=None.
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    # megatron-core 0.15's import builds a CUDA extension (inference/unified_memory.py); on a
    # CUDA build of torch without a GPU, torch cannot guess the architectures to build for and
    # raises IndexError, which that import does not catch. Named, the build fails the way
    # megatron-core expects where it cannot build (a warning), and the import goes on.
    env.setdefault("TORCH_CUDA_ARCH_LIST", "8.0")
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


def described(folder: str) -> "dict[str, str]":
    """The CPython, torch, numpy and setuptools of the venv at ``folder``, read from its
    pyvenv.cfg and its site-packages' *.dist-info folders (no process is started)."""
    out: "dict[str, str]" = {}
    try:
        with open(os.path.join(folder, "pyvenv.cfg")) as f:
            for line in f:
                key, _, value = line.partition("=")
                if key.strip() in ("version", "version_info"):
                    out["python"] = value.strip()
    except OSError:
        pass
    for info in glob.glob(os.path.join(folder, "lib", "python3*", "site-packages", "*.dist-info")):
        name, _, version = os.path.basename(info)[: -len(".dist-info")].partition("-")
        if name.lower() in ("torch", "numpy", "setuptools"):
            out[name.lower()] = version.split("+")[0]
    return out


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


def make_venv(
    folder: str,
    packages: "list[str]",
    python: "str | None" = None,
    label: str = "",
    pip_env: "dict[str, str] | None" = None,
) -> str:
    """A venv at ``folder`` with ``packages``; reused while its stamp matches."""
    spec = "%s|%s" % (python or "default", " ".join(packages))
    if _ready(folder, spec):
        return venv_python(folder)
    log("creating %s %s" % (os.path.relpath(folder, ROOT), label))
    started = time.time()
    shutil.rmtree(folder, ignore_errors=True)
    if python is None:
        venv.EnvBuilder(with_pip=True).create(folder)
    else:
        run(python, "-m", "venv", folder)
    py = venv_python(folder)
    if packages:
        pip_install(py, *packages, env=pip_env)
    _stamp(folder, spec)
    built(folder, started)
    return py


def tools() -> str:
    return make_venv(TOOLS, TOOL_REQUIREMENTS, label="(pytest, ruff, build)")


def e2e() -> str:
    return make_venv(E2E, [TORCH, *MEGATRON_DEPS], label="(torch 2.13.0, numpy, psutil, packaging)")


def torch_venv_folder(release: str) -> str:
    return os.path.join(TORCH_VENVS, release)


def _torch_packages(release: str) -> "list[str]":
    return ["torch==%s" % release, *MEGATRON_DEPS]


def _torch_installed(release: str) -> bool:
    return _ready(torch_venv_folder(release), "default|%s" % " ".join(_torch_packages(release)))


def torch_ready(release: str) -> bool:
    """Whether the venv of torch ``release`` is built (installed and pruned)."""
    return _torch_installed(release) and os.path.exists(os.path.join(torch_venv_folder(release), PRUNED))


def torch_venv(release: str) -> str:
    """The venv with real torch ``release`` (and megatron-core's few dependencies).

    Installed by pip with its dependencies, as a user gets it; a sibling of the same CUDA line
    is cloned first, so pip keeps the nvidia-* packages it already has. Then the nvidia
    libraries that a real save never maps are removed (``prune_unmapped_nvidia_libraries``).
    """
    folder = torch_venv_folder(release)
    packages = _torch_packages(release)
    if not _torch_installed(release):
        line = TORCH_MATRIX[release]
        siblings = [r for r in TORCH_MATRIX if TORCH_MATRIX[r] == line and r != release and _torch_installed(r)]
        sibling = siblings[0] if siblings else None
        started = time.time()
        ensure_free_space(TORCH_INSTALL_PEAK_GB, "installing torch %s" % release)
        if sibling is None:
            make_venv(folder, packages, label="(torch %s, %s)" % (release, line), pip_env=torch_pip_env(release))
        else:
            log("creating %s from a hard-link clone of torch %s (%s)" % (os.path.relpath(folder, ROOT), sibling, line))
            py = clone_venv(torch_venv_folder(sibling), folder)
            # The sibling's pruning marker came with the clone; what pip adds now is unpruned.
            for name in (PRUNED, ".envs-mapped"):
                if os.path.exists(os.path.join(folder, name)):
                    os.remove(os.path.join(folder, name))
            pip_install(py, *packages, env=torch_pip_env(release))
            _stamp(folder, "default|%s" % " ".join(packages))
        log("torch %s installed in %.0f s" % (release, time.time() - started))
    prune_unmapped_nvidia_libraries(folder)
    return venv_python(folder)


def torch_matrix(releases: "list[str] | None" = None) -> None:
    mcore([REFERENCE_MEGATRON])  # the pruning probe saves with it
    for release in releases or list(TORCH_MATRIX):
        torch_venv(release)


# The probe: run a script and write every file mapped into the process when it exits.
# Forked write workers map nothing their parent had not mapped already.
MAPPED_PROBE = """
import atexit, os, runpy, sys
def record():
    rows = [line.split(None, 5) for line in open("/proc/self/maps")]
    with open(os.environ["ENVS_MAPPED_OUT"], "w") as f:
        f.write("\\n".join(sorted({row[5].strip() for row in rows if len(row) == 6})))
atexit.register(record)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
PRUNED = ".envs-pruned"


def _probe_save(python: str, out: str) -> "set[str]":
    """Run examples/checkpoint_job.py (native megatron-core 0.13.1: no fix involved) and
    return the real paths of every file the process mapped."""
    job = os.path.join(ROOT, "examples", "checkpoint_job.py")
    env = child_env(PYTHONPATH=mcore_folder(REFERENCE_MEGATRON), ENVS_MAPPED_OUT=out, MCORE_AUTOPATCH="0")
    proc = subprocess.run([python, "-c", MAPPED_PROBE, job], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit("the probe save failed in %s" % python)
    with open(out) as f:
        return {os.path.realpath(line) for line in f.read().splitlines() if line}


def prune_unmapped_nvidia_libraries(folder: str) -> None:
    """Remove the nvidia-* shared libraries that importing torch and a real save never map.

    About 1.5 GB per CUDA line (cuDNN's engine libraries, cuSOLVER, ...): torch loads them
    lazily for GPU work only. Measured, not guessed: a probe save records what the process
    maps, everything else under site-packages/nvidia named ``*.so*`` goes, and a second probe
    save must still succeed. The list of removed files is kept in ``.envs-pruned``.
    """
    marker = os.path.join(folder, PRUNED)
    if os.path.exists(marker):
        return
    py = venv_python(folder)
    nvidia = os.path.join(site_packages(py), "nvidia")
    removed: "list[str]" = []
    freed = 0
    if os.path.isdir(nvidia):
        mapped = _probe_save(py, os.path.join(folder, ".envs-mapped"))
        for root, _dirs, files in os.walk(nvidia):
            for name in files:
                path = os.path.join(root, name)
                if ".so" in name and os.path.realpath(path) not in mapped:
                    freed += os.stat(path).st_size
                    os.remove(path)
                    removed.append(os.path.relpath(path, nvidia))
        _probe_save(py, os.path.join(folder, ".envs-mapped"))  # still imports and saves
    with open(marker, "w") as f:
        f.write("".join("%s\n" % name for name in sorted(removed)))
    where = os.path.relpath(folder, ROOT)
    log(
        "%s: removed %d unmapped nvidia libraries (%.0f MB); %.2f GB left"
        % (where, len(removed), freed / 2**20, folder_size(folder) / 1e9)
    )


def _seed_spec() -> str:
    return "torch %s clone|%s|megatron-core==%s --no-deps" % (SEED_TORCH, RAY, SEED_MEGATRON)


def seed_ready() -> bool:
    return _ready(SEED, _seed_spec())


def seed_stack() -> str:
    """The stack of the report this project answers: megatron-core 0.12.1 installed *into*
    a venv with torch 2.9.0 (not on PYTHONPATH), and Ray, whose worker processes are started
    by its raylet and never import mcore_autopatch. The wheel is not installed here; tests
    install it into a clone."""
    if seed_ready():
        return venv_python(SEED)
    torch_venv(SEED_TORCH)
    where = os.path.relpath(SEED, ROOT)
    log("creating %s (torch %s, megatron-core %s in the venv, %s)" % (where, SEED_TORCH, SEED_MEGATRON, RAY))
    py = clone_venv(torch_venv_folder(SEED_TORCH), SEED)
    pip_install(py, RAY)
    pip_install(py, "--no-deps", "megatron-core==%s" % SEED_MEGATRON)
    _stamp(SEED, _seed_spec())
    log("%s built (%.2f GB, hard links to torch %s's files counted)" % (where, folder_size(SEED) / 1e9, SEED_TORCH))
    return py


def nvrx_folder(version: str) -> str:
    return os.path.join(NVRX, version)


def nvrx(versions: "list[str]" = NVRX_VERSIONS) -> None:
    """nvidia-resiliency-ext releases in --target folders (--no-deps: only the checkpointing
    writer is used, which needs torch and psutil, both in the e2e venv)."""
    for version in versions:
        target_install(nvrx_folder(version), "nvidia-resiliency-ext==%s" % version)


def target_install(folder: str, *specs: str) -> None:
    """``pip install --no-deps --target folder specs`` with the e2e venv's pip, once."""
    spec = " ".join(specs)
    if _ready(folder, spec):
        return
    log("installing %s into %s" % (spec, os.path.relpath(folder, ROOT)))
    started = time.time()
    shutil.rmtree(folder, ignore_errors=True)
    pip_install(e2e(), "--no-deps", "--target", folder, *specs)
    _stamp(folder, spec)
    built(folder, started)


def mcore_folder(version: str) -> str:
    return os.path.join(MCORE, version)


def mcore(versions: "list[str]" = MEGATRON_VERSIONS) -> None:
    # megatron-core alone: 0.7 and 0.8 import pkg_resources, and nothing here brings one along
    # (the fresh venvs have setuptools >= 82, as a fresh image does).
    for version in versions:
        target_install(mcore_folder(version), "megatron-core==%s" % version)


# --- what a fresh image has around megatron-core ---------------------------------------------

FRESH = os.path.join(CACHE, "fresh")
# numpy lines: the newest numpy 2 (what `pip install megatron-core==0.12.1` next to torch gets)
# and the numpy 1 that images pinning numpy<2 have. Each fresh venv also gets the newest
# setuptools, which has no pkg_resources.
NUMPY_LINES = {"numpy2": "numpy>=2", "numpy1": "numpy==1.26.4"}
FRESH_SETUPTOOLS = "setuptools>=82"
# torch 2.9.0: the first release that drops mcore_data; 2.15.0: the registry's newest; 2.13.0:
# the CPU wheel (megatron-core 0.14 and 0.15 save on CPU there only).
FRESH_TORCH = ["2.9.0", "2.13.0", "2.15.0"]


def fresh_folder(release: str, numpy_line: str) -> str:
    return os.path.join(FRESH, "%s-%s" % (release, numpy_line))


def _fresh_spec(release: str, numpy_line: str) -> str:
    return "torch %s clone|%s %s" % (release, NUMPY_LINES[numpy_line], FRESH_SETUPTOOLS)


def fresh_ready(release: str, numpy_line: str) -> bool:
    return _ready(fresh_folder(release, numpy_line), _fresh_spec(release, numpy_line))


def fresh_venv(release: str, numpy_line: str) -> str:
    """A hard-link clone of the venv of torch ``release``, then pip: that numpy line and the
    newest setuptools."""
    folder = fresh_folder(release, numpy_line)
    if fresh_ready(release, numpy_line):
        return venv_python(folder)
    source = E2E if release == CPU_TORCH_RELEASE else torch_venv_folder(release)
    if release == CPU_TORCH_RELEASE:
        e2e()
    else:
        torch_venv(release)
    started = time.time()
    log(
        "creating %s (torch %s, %s, %s)"
        % (os.path.relpath(folder, ROOT), release, NUMPY_LINES[numpy_line], FRESH_SETUPTOOLS)
    )
    py = clone_venv(source, folder)
    pip_install(py, "--upgrade", NUMPY_LINES[numpy_line], FRESH_SETUPTOOLS)
    _stamp(folder, _fresh_spec(release, numpy_line))
    built(folder, started)
    return py


def fresh(releases: "list[str] | None" = None) -> None:
    for release in releases or FRESH_TORCH:
        for numpy_line in NUMPY_LINES:
            fresh_venv(release, numpy_line)


# setuptools 70.0 - 70.3: a pkg_resources without the ``packaging`` megatron-core 0.7/0.8 import.
OLD_SETUPTOOLS = "70.3.0"


def setuptools_folder(version: str = OLD_SETUPTOOLS) -> str:
    return os.path.join(CACHE, "setuptools", version)


def old_setuptools() -> None:
    target_install(setuptools_folder(), "setuptools==%s" % OLD_SETUPTOOLS)


# CPython 3.12, the interpreter of vLLM images: megatron-core <= 0.13 has no wheel for it, so
# its release folders (pure Python) run there from PYTHONPATH, as users run them.
PY312 = os.path.join(CACHE, "py312")
PY312_TORCH = "2.9.0"


def _py312_spec() -> str:
    return "3.12|torch==%s %s psutil packaging %s" % (PY312_TORCH, NUMPY_LINES["numpy2"], FRESH_SETUPTOOLS)


def py312_ready() -> bool:
    return _ready(PY312, _py312_spec()) and os.path.exists(os.path.join(PY312, PRUNED))


def py312() -> "str | None":
    """torch 2.9.0 (a CUDA build, with its nvidia-* dependencies) for CPython 3.12. The nvidia
    libraries and torch's own shared libraries are the same files as the 3.11 venv of torch
    2.9.0 has: they are pruned the same way and then hard-linked to that venv's copies, so
    they are stored once."""
    python = find_python("3.12")
    if python is None:
        log("CPython 3.12 not found; the 3.12 row is skipped")
        return None
    if py312_ready():
        return venv_python(PY312)
    torch_venv(PY312_TORCH)  # the copies to link to
    ensure_free_space(TORCH_INSTALL_PEAK_GB, "installing torch %s for CPython 3.12" % PY312_TORCH)
    started = time.time()
    log("creating %s (CPython 3.12, torch %s, numpy 2)" % (os.path.relpath(PY312, ROOT), PY312_TORCH))
    shutil.rmtree(PY312, ignore_errors=True)
    run(python, "-m", "venv", PY312)
    packages = ["torch==%s" % PY312_TORCH, NUMPY_LINES["numpy2"], "psutil", "packaging", FRESH_SETUPTOOLS]
    pip_install(venv_python(PY312), *packages)
    _stamp(PY312, _py312_spec())
    prune_unmapped_nvidia_libraries(PY312)
    linked = link_identical_files(
        site_packages(venv_python(PY312)), site_packages(venv_python(torch_venv_folder(PY312_TORCH)))
    )
    count, megabytes = linked
    where = os.path.relpath(PY312, ROOT)
    log("%s: %d files hard-linked to torch %s's venv (%.0f MB stored once)" % (where, count, PY312_TORCH, megabytes))
    built(PY312, started)
    return venv_python(PY312)


def link_identical_files(folder: str, reference: str) -> "tuple[int, float]":
    """Replace each file under ``folder`` that is byte-identical to the file at the same path
    under ``reference`` with a hard link to it. Returns (files, MB). Only files of 1 MB and
    more are compared: the shared libraries of the same torch build for another CPython
    (libtorch_cuda.so alone is 1 GB) and its nvidia-* libraries."""
    import filecmp

    count, saved = 0, 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            twin = os.path.join(reference, os.path.relpath(path, folder))
            if os.path.islink(path) or not os.path.isfile(twin) or os.path.samefile(path, twin):
                continue
            size = os.stat(path).st_size
            if size < 2**20 or size != os.stat(twin).st_size or not filecmp.cmp(path, twin, shallow=False):
                continue
            os.remove(path)
            os.link(twin, path)
            count, saved = count + 1, saved + size
    return count, saved / 2**20


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
    # The venv itself, not a symbolic link to it: cp would copy the link, and pip would then
    # install into the cached venv through it.
    run("cp", "-al", os.path.realpath(source), target)
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
    pip_install(py, "--no-deps", spec)
    open(marker, "w").close()


# `make gpu-check-prepare`: what tools/gpu_check.sh installs on a GPU machine that reaches no
# registry (its python is 3.12): our wheel, numpy 1.26.4 for Python 3.12, and megatron-core
# 0.12.1 / nvidia-resiliency-ext 0.3.0 as installed folders (pure Python where it matters;
# megatron-core 0.12.1 has no wheel for 3.12). Well under the 64 MiB a device call carries.
GPU_CHECK = os.path.join(ROOT, ".gpu-check")
GPU_PYTHON_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
GPU_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def gpu_check_prepare() -> None:
    shutil.rmtree(GPU_CHECK, ignore_errors=True)
    os.makedirs(GPU_CHECK)
    wheel(GPU_CHECK)
    platforms = [arg for p in GPU_PLATFORMS for arg in ("--platform", p)]
    run(
        e2e(),
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        *GPU_PYTHON_TAGS,
        *platforms,
        "-d",
        GPU_CHECK,
        "numpy==1.26.4",
    )
    mcore(["0.12.1"])
    nvrx(["0.3.0"])
    ignore = shutil.ignore_patterns("__pycache__", "*.so", ".envs-stamp")
    shutil.copytree(mcore_folder("0.12.1"), os.path.join(GPU_CHECK, "mcore-0.12.1"), ignore=ignore)
    shutil.copytree(nvrx_folder("0.3.0"), os.path.join(GPU_CHECK, "nvrx-0.3.0"), ignore=ignore)
    log("%s ready: carry it with `make gpu-check` to a GPU machine" % os.path.relpath(GPU_CHECK, ROOT))


def fresh_cpu() -> None:
    """The everyday tier's fresh image: torch 2.13.0 (the CPU wheel), numpy 2, setuptools 82+."""
    fresh_venv(CPU_TORCH_RELEASE, "numpy2")


# What `make test` needs: torch 2.13.0 (the CPU wheel on this disk), its numpy 2 clone, the
# megatron-core and nvidia-resiliency-ext folders. Built from nothing in about 2 minutes.
EVERYDAY_TARGETS = ["tools", "e2e", "mcore", "setuptools", "nvrx", "fresh-cpu"]
# What `make test-matrix` needs besides, in order (torch before seed: the seed stack clones
# torch 2.9.0).
DEFAULT_TARGETS = [*EVERYDAY_TARGETS, "pythons", "torch", "seed", "fresh", "py312"]
TARGETS = {
    "tools": tools,
    "e2e": e2e,
    "mcore": mcore,
    "pythons": pythons,
    "torch": torch_matrix,
    "seed": seed_stack,
    "fresh": fresh,
    "fresh-cpu": fresh_cpu,
    "setuptools": old_setuptools,
    "py312": py312,
    "nvrx": nvrx,
    "wheel": lambda: print(wheel()),
    "demo": demo_megatron,
    "gpu-check": gpu_check_prepare,
}


GROUPS = {"everyday": EVERYDAY_TARGETS}  # a name for several targets


def main(argv: "list[str]") -> int:
    names = [target for name in (argv or DEFAULT_TARGETS) for target in GROUPS.get(name, [name])]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        print(
            "unknown target(s): %s; choose from %s" % (", ".join(unknown), ", ".join([*GROUPS, *TARGETS])),
            file=sys.stderr,
        )
        return 2
    for name in names:
        started = time.time()
        TARGETS[name]()
        if time.time() - started > 1:  # say what a first build cost; a cached one is silent
            log("%s ready in %.0f s" % (name, time.time() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
