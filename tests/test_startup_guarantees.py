"""Fail-safe startup: the hook can never break, slow down or surprise an interpreter.

``mcore_autopatch.pth`` runs in every interpreter of an image, most of which never touch
megatron-core. Each guarantee below is checked in subprocesses of small venvs without
torch: one with our wheel installed by pip, and a twin without it for comparison. Where a
megatron-core writer module is needed, a ``fake_`` folder built here from strings stands in
(a fake megatron package and a fake torch filesystem module): these venvs have no torch.
"""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import pytest
from conftest import clean_env, run_python

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
# Finders put on sys.meta_path by any copy of mcore_autopatch.
COUNT_FINDERS = "sum(type(f).__module__ == 'mcore_autopatch' for f in sys.meta_path)"
PRINT_FINDERS = "import sys; print(%s)" % COUNT_FINDERS
PRINT_MODULES = "import sys; print(' '.join(sorted(sys.modules)))"
EXIT_3 = "import sys\nsys.exit(3)\n"
# Modules a careless startup hook pulls in (virtualenv #2317/#2688, setuptools #3006).
HEAVY = [
    "threading",
    "importlib.util",
    "contextlib",
    "re",
    "logging",
    "packaging",
    "importlib.metadata",
    "typing",
    "__future__",
    "inspect",
]
TIMEOUT = 120


# --- venvs -----------------------------------------------------------------------------


class Venv:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.python = os.path.join(folder, "bin", "python")
        self.site_packages = os.path.join(folder, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")


def make_venv(folder: str, *requirements: str) -> Venv:
    """``python -m venv --without-pip`` (no setuptools .pth of its own), then this
    process's pip installs ``requirements`` into it, as ``pip install`` would."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True, timeout=TIMEOUT)
    venv = Venv(folder)
    assert os.path.isdir(venv.site_packages), venv.site_packages
    if requirements:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                venv.python,
                "install",
                "-q",
                "--disable-pip-version-check",
                *requirements,
            ],
            check=True,
            capture_output=True,
            timeout=600,
            env=clean_env(),
        )
    return venv


@pytest.fixture(scope="module")
def venvs(wheel_path: str, tmp_path_factory: Any) -> Tuple[Venv, Venv]:
    """(with our wheel, twin with only its dependency). Not to be modified by tests."""
    root = tmp_path_factory.mktemp("startup-venvs")
    return make_venv(str(root / "with"), wheel_path), make_venv(str(root / "twin"), "packaging")


@pytest.fixture
def own_venv(wheel_path: str, tmp_path: Any) -> Venv:
    """A venv with the wheel, for a test that breaks its installation on purpose."""
    return make_venv(str(tmp_path / "own"), wheel_path)


@pytest.fixture
def workdir(tmp_path: Any) -> str:
    """A working directory of its own, so nothing is read from the repository checkout."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    return str(folder)


def run(venv: Venv, args: List[str], cwd: str, timeout: float = TIMEOUT, **env: Optional[str]) -> Any:
    return run_python(venv.python, args, clean_env(**env), timeout=timeout, cwd=cwd)


def finders(venv: Venv, cwd: str, *flags: str, **env: Optional[str]) -> int:
    proc = run(venv, [*flags, "-c", PRINT_FINDERS], cwd, **env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return int(proc.stdout)


def modules(venv: Venv, cwd: str, *flags: str, **env: Optional[str]) -> "set[str]":
    proc = run(venv, [*flags, "-c", PRINT_MODULES], cwd, **env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return set(proc.stdout.split())


def assert_silent_runs(venv: Venv, cwd: str, flags: List[str], **env: Optional[str]) -> None:
    """``-c pass`` exits 0 and a script exiting 3 exits 3, both without a byte of output."""
    script = os.path.join(cwd, "exit3.py")
    with open(script, "w") as f:
        f.write(EXIT_3)
    for args, expected in (([*flags, "-c", "pass"], 0), ([*flags, script], 3)):
        proc = run(venv, args, cwd, **env)
        assert (proc.returncode, proc.stdout, proc.stderr) == (expected, "", ""), args


# --- fake megatron-core and torch (these venvs have no torch) ----------------------------

FAKE_TORCH_FILES = {
    "torch/__init__.py": '"""fake torch: only a version and the checkpoint filesystem module."""\n'
    '__version__ = "2.8.0+fake"\n',
    "torch/distributed/__init__.py": "",
    "torch/distributed/checkpoint/__init__.py": "",
    "torch/distributed/checkpoint/filesystem.py": '"""fake torch filesystem: torch 2.8\'s _write_item signature."""\n'
    "import enum\n\n\n"
    "class SerializationFormat(enum.Enum):\n"
    '    TORCH_SAVE = "torch_save"\n'
    '    SAFETENSORS = "safetensors"\n\n\n'
    "class _StorageWriterTransforms:\n"
    "    pass\n\n\n"
    "def _write_item(transforms, stream, data, write_item, storage_key, serialization_format):\n"
    "    return serialization_format\n",
}
FAKE_MEGATRON_FILES = {
    "megatron/__init__.py": "",
    "megatron/core/__init__.py": "",
    "megatron/core/package_info.py": '__version__ = "0.12.1"\n',
    "megatron/core/dist_checkpointing/__init__.py": "",
    "megatron/core/dist_checkpointing/strategies/__init__.py": "",
    "megatron/core/dist_checkpointing/strategies/filesystem_async.py": '"""fake megatron-core 0.12 writer module:'
    ' only the _write_item global."""\n'
    "from torch.distributed.checkpoint.filesystem import _write_item\n",
}
# The writer body waits until another thread has finished an import; were our finder or
# callback to hold a lock that thread needs, the body would wait forever (the subprocess
# timeout then ends it).
FAKE_BLOCKING_WRITER = '''"""fake megatron-core writer whose body waits for an import made by another thread."""
import threading

from torch.distributed.checkpoint.filesystem import _write_item

_done = threading.Event()


def _import_elsewhere():
    import fake_other_thread_module  # noqa: F401

    _done.set()


_thread = threading.Thread(target=_import_elsewhere)
_thread.start()
_done.wait()
_thread.join()
'''
FAKE_OTHER_THREAD_MODULE = '''"""fake: imported by a second thread while the writer module is executing."""
import json  # not imported yet: a real find through every finder, ours included
import mcore_autopatch.fixes.write_item  # what our callback needs, imported first by this thread
import megatron.core.dist_checkpointing  # a parent of the writer, already imported
'''
FAKE_EVIL = '''"""fake_evil: must never be imported; it leaves a marker file and prints if it is."""
import os

open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_evil_ran"), "w").close()
print("fake_evil imported")


def run(*args, **kwargs):
    print("fake_evil.run called")
'''
# Imports the writer twice (re-import after removal) and prints what happened as JSON.
IMPORT_WRITER_TWICE = """
import importlib, json, sys
results = []
for _ in range(2):
    for name in [m for m in sys.modules if m.startswith("megatron")]:
        del sys.modules[name]
    w = importlib.import_module(%r)
    results.append(bool(getattr(w._write_item, "__mcore_autopatch__", False)))
    fmt = w._write_item(None, "stream", "data", "item", "key") if results[-1] else None
print(json.dumps({"applied": results, "format": getattr(fmt, "name", None), "modules": sorted(sys.modules)}))
""" % (WRITER,)


def write_tree(root: str, files: Dict[str, str]) -> str:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return root


@pytest.fixture
def fake_megatron(tmp_path: Any) -> str:
    """A PYTHONPATH folder with a fake megatron-core 0.12.1 writer and a fake torch 2.8."""
    return write_tree(str(tmp_path / "fake_megatron_and_torch"), {**FAKE_TORCH_FILES, **FAKE_MEGATRON_FILES})


def last_json(proc: Any) -> Dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines and proc.returncode == 0, "rc=%s\n%s\n%s" % (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(lines[-1])


# --- imports -----------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [[], ["-I"]], ids=["plain", "isolated"])
def test_startup_imports_only_mcore_autopatch_beyond_bare_python(venvs, workdir, flags):
    """``python -c pass`` loads exactly one module more: our stdlib-only ``__init__``."""
    ours, twin = venvs
    with_wheel = modules(ours, workdir, *flags)
    bare = modules(twin, workdir, *flags)
    assert with_wheel - bare == {"mcore_autopatch"}
    assert bare - with_wheel == set()
    for name in HEAVY:
        assert not (name in with_wheel and name not in bare), name


# --- silence and exit codes ----------------------------------------------------------------

FLAG_CASES = {
    "plain": ([], {}),
    "isolated_I": (["-I"], {}),
    "ignore_environment_E": (["-E"], {}),
    "no_user_site_s": (["-s"], {}),
    "safe_path_P": (["-P"], {}),
    "dev_mode": (["-X", "dev"], {}),
    "warnings_as_errors_W": (["-W", "error"], {}),
    "pythonwarnings_error": ([], {"PYTHONWARNINGS": "error"}),
    "dev_mode_and_debug_log": (["-X", "dev", "-W", "error"], {"MCORE_AUTOPATCH_LOG": "debug"}),
}


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_startup_under_interpreter_flags_is_silent_and_keeps_exit_code(venvs, workdir, case):
    """No byte on stdout/stderr and the exit code of the program, while the hook is active.
    (``-X importtime`` is left out: it prints by design.)"""
    flags, env = FLAG_CASES[case]
    ours, twin = venvs
    assert finders(ours, workdir, *flags, **env) == 1  # the .pth did run under these flags
    assert finders(twin, workdir, *flags, **env) == 0
    assert_silent_runs(ours, workdir, flags, **env)


# Simulates a read-only site-packages even for root: an audit hook, installed before site
# runs, refuses every write under the venv the way a read-only file system would.
READ_ONLY_STARTUP = """
import os, sys
root = %r
refused = []
def hook(event, args):
    if event == "open" and str(args[0]).startswith(root):
        mode, flags = args[1], args[2] or 0
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
    elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.chmod", "os.truncate"):
        writing = str(args[0]).startswith(root)
    else:
        return
    if writing:
        refused.append(event)
        raise PermissionError(30, "Read-only file system (simulated)", str(args[0]))
sys.addaudithook(hook)
import site
site.main()
print(%s, len(refused))
"""


def tree(folder: str) -> Dict[str, Tuple[int, int]]:
    result = {}
    for base, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(base, name)
            st = os.lstat(path)
            result[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns)
    return result


def test_read_only_site_packages_without_bytecode_is_silent_and_hook_active(own_venv, workdir):
    """With ``__pycache__`` gone, Python tries to write bytecode; on a read-only
    site-packages that fails, and startup must still be silent with the hook in place."""
    shutil.rmtree(os.path.join(own_venv.site_packages, "mcore_autopatch", "__pycache__"))
    before = tree(own_venv.folder)
    code = READ_ONLY_STARTUP % (own_venv.folder, COUNT_FINDERS)
    proc = run(own_venv, ["-S", "-P", "-c", code], workdir)
    assert (proc.returncode, proc.stderr) == (0, "")
    found, refused = map(int, proc.stdout.split())
    assert found == 1
    assert refused >= 1  # the simulation did refuse a write (importlib's bytecode cache)
    assert tree(own_venv.folder) == before


def test_installed_wheel_startup_writes_nothing_to_the_venv(own_venv, workdir):
    """pip compiled the bytecode at install; a start then changes no file of the venv."""
    before = tree(own_venv.folder)
    assert_silent_runs(own_venv, workdir, [])
    assert finders(own_venv, workdir) == 1
    assert tree(own_venv.folder) == before


# --- broken or skewed installations -------------------------------------------------------------


def test_pth_left_behind_without_its_package_is_silent(own_venv, workdir):
    """A .pth orphaned by a partial uninstall must not print "Error processing line 1"
    at every start (setuptools #2983)."""
    shutil.rmtree(os.path.join(own_venv.site_packages, "mcore_autopatch"))
    assert os.path.exists(os.path.join(own_venv.site_packages, "mcore_autopatch.pth"))
    assert_silent_runs(own_venv, workdir, [])
    assert finders(own_venv, workdir) == 0
    assert "mcore_autopatch" not in modules(own_venv, workdir)


SKEWED_PACKAGES = {
    "package_lacks_activate": '"""fake_older mcore_autopatch without activate."""\n__version__ = "0.0.1"\n',
    "activate_needs_an_argument": '"""fake_other mcore_autopatch."""\n\n\ndef activate(required):\n    return True\n',
    "activate_raises": '"""fake_newer mcore_autopatch."""\n\n\ndef activate():\n    raise RuntimeError("boom")\n',
    "package_init_raises": '"""fake_broken mcore_autopatch."""\nraise ImportError("half-upgraded")\n',
    "package_init_has_syntax_error": '"""fake_broken mcore_autopatch."""\ndef activate(:\n',
}


@pytest.mark.parametrize("case", list(SKEWED_PACKAGES))
def test_pth_and_package_from_different_versions_are_silent(own_venv, workdir, case):
    """The .pth of one release with the package of another (a half-finished upgrade)."""
    package = os.path.join(own_venv.site_packages, "mcore_autopatch")
    shutil.rmtree(os.path.join(package, "__pycache__"))
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(SKEWED_PACKAGES[case])
    assert_silent_runs(own_venv, workdir, [])
    assert finders(own_venv, workdir) == 0


def test_pth_calling_a_function_the_package_lacks_is_silent(own_venv, workdir):
    """A newer .pth that calls a function this package does not have."""
    pth = os.path.join(own_venv.site_packages, "mcore_autopatch.pth")
    with open(pth) as f:
        line = f.read()
    assert "m.activate()" in line
    with open(pth, "w") as f:
        f.write(line.replace("m.activate()", "m.activate_v2()"))
    assert_silent_runs(own_venv, workdir, [])
    assert finders(own_venv, workdir) == 0


# --- MCORE_AUTOPATCH values ---------------------------------------------------------------------

ODD_VALUES = {
    "unknown_word": "bogus",
    "empty": "",
    "spaces": "   ",
    "non_ascii": "ö",
    "fullwidth_off": "\uff4f\uff46\uff46",  # fullwidth "off": lower() keeps it fullwidth, not an off word
    "invalid_utf8_byte": "\udcff",  # os.fsencode gives the child the raw byte 0xff
    "module_path": "os:system",
    "newline_inside": "o\nff",
}


@pytest.mark.parametrize("case", list(ODD_VALUES))
def test_odd_mcore_autopatch_value_is_silent_and_behaves_as_auto(venvs, workdir, case):
    """No value makes startup print or fail; none of these is an off word, so the hook stays."""
    ours, _ = venvs
    env = {"MCORE_AUTOPATCH": ODD_VALUES[case], "MCORE_AUTOPATCH_LOG": "debug"}
    assert_silent_runs(ours, workdir, [], **env)
    assert finders(ours, workdir, **env) == 1


def test_unknown_mode_is_warned_once_when_the_writer_loads_and_acts_as_auto(venvs, workdir, fake_megatron):
    """The startup room cannot log; the first writer import reports the value, once, and
    applies the fix as ``auto`` would. ``MCORE_AUTOPATCH=0`` shows the fix is really ours."""
    ours, _ = venvs
    env = {"PYTHONPATH": fake_megatron, "MCORE_AUTOPATCH_LOG": "warning"}
    proc = run(ours, ["-c", IMPORT_WRITER_TWICE], workdir, MCORE_AUTOPATCH="sometimes", **env)
    result = last_json(proc)
    assert result["applied"] == [True, True]
    assert result["format"] == "TORCH_SAVE"
    lines = [ln for ln in proc.stderr.splitlines() if "MCORE_AUTOPATCH" in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mcore_autopatch[pid ") and "WARNING" in lines[0]

    off = last_json(run(ours, ["-c", IMPORT_WRITER_TWICE], workdir, MCORE_AUTOPATCH="0", **env))
    assert off["applied"] == [False, False]
    known = run(ours, ["-c", IMPORT_WRITER_TWICE], workdir, MCORE_AUTOPATCH="auto", **env)
    assert last_json(known)["applied"] == [True, True]
    assert "MCORE_AUTOPATCH" not in known.stderr


# --- concurrency ------------------------------------------------------------------------------


def test_import_in_another_thread_during_writer_import_does_not_deadlock(venvs, workdir, fake_megatron):
    """The writer body waits for a second thread's import (through our finder, of what our
    callback needs); a lock held by the hook would hang it until the timeout."""
    ours, _ = venvs
    write_tree(
        fake_megatron,
        {
            "megatron/core/dist_checkpointing/strategies/filesystem_async.py": FAKE_BLOCKING_WRITER,
            "fake_other_thread_module.py": FAKE_OTHER_THREAD_MODULE,
        },
    )
    try:
        proc = run(ours, ["-c", IMPORT_WRITER_TWICE], workdir, timeout=90, PYTHONPATH=fake_megatron)
    except subprocess.TimeoutExpired:
        pytest.fail("importing the writer module while another thread imports deadlocked")
    result = last_json(proc)
    assert result["applied"] == [True, True]
    assert "fake_other_thread_module" in result["modules"]
    assert proc.stderr == ""


# --- security posture ---------------------------------------------------------------------------

HOSTILE_ENVS = {
    "module_names_of_a_planted_file": {"MCORE_AUTOPATCH": "fake_evil:run", "MCORE_AUTOPATCH_LOG": "fake_evil"},
    "stdlib_callables": {"MCORE_AUTOPATCH": "os:system", "MCORE_AUTOPATCH_LOG": "subprocess:run"},
    "python_expressions": {
        "MCORE_AUTOPATCH": "__import__('fake_evil')",
        "MCORE_AUTOPATCH_LOG": "logging.config:fileConfig",
    },
}


@pytest.mark.parametrize("case", list(HOSTILE_ENVS))
def test_environment_values_never_import_or_run_anything_else(venvs, workdir, fake_megatron, case):
    """Our variables are words, never module paths: at startup and when the writer loads,
    the set of imported modules is the one ``auto`` gives, and the planted module never runs."""
    ours, _ = venvs
    write_tree(fake_megatron, {"fake_evil.py": FAKE_EVIL})
    hostile = HOSTILE_ENVS[case]
    baseline = {"PYTHONPATH": fake_megatron}
    assert modules(ours, workdir, **baseline, **hostile) == modules(ours, workdir, **baseline)
    loaded = last_json(run(ours, ["-c", IMPORT_WRITER_TWICE], workdir, **baseline, **hostile))
    reference = last_json(run(ours, ["-c", IMPORT_WRITER_TWICE], workdir, **baseline))
    assert loaded["applied"] == reference["applied"] == [True, True]
    assert set(loaded["modules"]) == set(reference["modules"])
    assert "fake_evil" not in loaded["modules"]
    assert not os.path.exists(os.path.join(fake_megatron, "fake_evil_ran"))


def test_module_named_like_ours_in_the_working_directory_is_never_run_at_startup(venvs, workdir):
    """site processes .pth files before the working directory joins sys.path."""
    ours, _ = venvs
    write_tree(workdir, {"mcore_autopatch.py": FAKE_EVIL.replace("fake_evil", "fake_mcore_autopatch_in_cwd")})
    for args in (["-c", "pass"], ["-m", "json.tool", "--help"]):
        proc = run(ours, args, workdir)
        assert "fake_mcore_autopatch_in_cwd" not in proc.stdout + proc.stderr
    assert not os.path.exists(os.path.join(workdir, "fake_mcore_autopatch_in_cwd_ran"))
    assert finders(ours, workdir) == 1


# Records audit events while site processes site-packages, as normal startup does; -S
# defers site so that the hook is in place first, -P keeps the working directory off
# sys.path as it is during real startup.
AUDIT_STARTUP = """
import sys
events = []
recording = [True]
def hook(event, args):
    if not recording[0]:
        return
    if event == "open":
        events.append([event, str(args[0]), str(args[1]), args[2] if isinstance(args[2], int) else 0])
    elif event == "import":
        events.append([event, str(args[0])])
    elif event == "exec":
        events.append([event, str(getattr(args[0], "co_filename", args[0]))])
    elif event.startswith(("os.", "socket.", "subprocess.", "shutil.", "urllib.", "http.", "ctypes.")):
        events.append([event] + [str(a) for a in args])
sys.addaudithook(hook)
import site
site.main()
recording[0] = False
import json
print(json.dumps({"events": events, "path": sys.path, "finders": %s}))
""" % (COUNT_FINDERS,)


def audit(venv: Venv, cwd: str) -> Dict[str, Any]:
    result = last_json(run(venv, ["-S", "-P", "-c", AUDIT_STARTUP], cwd))
    normalised = []
    for event in result["events"]:
        normalised.append(tuple(str(x).replace(venv.folder, "<venv>") if isinstance(x, str) else x for x in event))
    result["events"] = normalised
    return result


def test_startup_reads_only_its_own_files_writes_nothing_and_opens_no_socket(venvs, workdir):
    """Every audit event our .pth adds to site's run concerns our own files and the import
    of ``mcore_autopatch``; nothing touches the working directory, writes, or connects."""
    write_tree(workdir, {"mcore_autopatch.pth": "import fake_cwd_pth\n", "fake_cwd_pth.py": FAKE_EVIL})
    ours, twin = venvs
    result, bare = audit(ours, workdir), audit(twin, workdir)
    assert result["finders"] == 1 and bare["finders"] == 0
    added = Counter(result["events"]) - Counter(bare["events"])
    sp = "<venv>" + ours.site_packages[len(ours.folder) :]
    package = sp + "/mcore_autopatch/"
    own_paths = {sp + "/mcore_autopatch.pth"}
    for event in added:
        kind = event[0]
        if kind == "open":
            _, path, mode, flags = event
            assert path in own_paths or (path.startswith(package) and path.endswith((".py", ".pyc"))), event
            assert mode == "r" and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) == 0, event
        elif kind == "import":
            assert event[1] == "mcore_autopatch", event
        elif kind == "exec":
            assert event[1] in ("<string>", package + "__init__.py"), event
        elif kind == "os.listdir":
            assert event[1] in [p.replace(ours.folder, "<venv>") for p in result["path"]], event
        else:
            pytest.fail("unexpected audit event at startup: %r" % (event,))
    assert ("import", "mcore_autopatch") in added  # the hook's own work was seen
    for event in result["events"]:
        assert not event[0].startswith(("socket.", "subprocess.", "urllib.", "http.", "ctypes.")), event
        assert event[0] not in ("os.system", "os.exec", "os.posix_spawn", "os.fork"), event
        assert not any(workdir in str(part) for part in event[1:]), event
        if event[0] == "open":
            assert event[2] == "r" and event[3] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) == 0, event


# --- the finder ---------------------------------------------------------------------------

REJECT_PATH = """
import sys
finder = [f for f in sys.meta_path if type(f).__module__ == "mcore_autopatch"][0]
names = sys.argv[1:]
before = set(sys.modules)
specs = [finder.find_spec(name, None, None) for name in names]
added = sorted(set(sys.modules) - before)
import json
print(json.dumps({"specs": [repr(s) for s in specs], "added": added}))
"""


def test_finder_rejects_other_names_without_importing_anything(venvs, workdir):
    """``find_spec`` runs for every import of the process: for a name it does not watch
    it returns None and loads nothing. A watched name (positive control) does load the
    import hook, which shows that the check would see an import."""
    ours, _ = venvs
    others = ["json", "megatron", "megatron.core", "megatron.core.dist_checkpointing.strategies", "torch", "zz_none"]
    proc = run(ours, ["-c", REJECT_PATH, *others], workdir)
    assert proc.stderr == ""
    assert last_json(proc) == {"specs": ["None"] * len(others), "added": []}
    watched = last_json(run(ours, ["-c", REJECT_PATH, WRITER], workdir))
    assert watched["specs"] == ["None"]  # no megatron here
    assert "mcore_autopatch.importhook" in watched["added"]


ACTIVATE_OFTEN = """
import importlib, pkgutil, site, sys
import mcore_autopatch
results = [mcore_autopatch.activate(), mcore_autopatch.activate(), mcore_autopatch.install()]
site.main()  # a venv's site-packages can be processed twice (gh-75723)
results.append(pkgutil.resolve_name("mcore_autopatch:activate")())
fresh = importlib.reload(mcore_autopatch)  # another copy of the module and its finder class
results.append(fresh.activate())
print(results, %s)
""" % (COUNT_FINDERS,)


def test_activate_run_any_number_of_times_installs_exactly_one_finder(venvs, workdir):
    ours, _ = venvs
    proc = run(ours, ["-c", ACTIVATE_OFTEN], workdir)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "[True, True, True, True, True] 1"


@pytest.mark.parametrize("value", ["0", "off", "false", "no", " OFF ", "False"])
def test_mcore_autopatch_off_installs_no_finder_at_all(venvs, workdir, value):
    """Off means off: not at startup, not by a later activate() or install()."""
    ours, _ = venvs
    assert finders(ours, workdir, MCORE_AUTOPATCH=value) == 0
    code = "import sys, mcore_autopatch; print(mcore_autopatch.activate(), mcore_autopatch.install(), %s)"
    proc = run(ours, ["-c", code % COUNT_FINDERS], workdir, MCORE_AUTOPATCH=value)
    assert (proc.stdout.strip(), proc.stderr) == ("False False 0", "")
