"""The startup hook on the other CPython minors the package supports (3.8-3.13).

torch is not installed for these interpreters, so a FAKE torch and a FAKE megatron-core
0.12.1 (``tests/fakes``) sit on ``PYTHONPATH``. Each minor's small venv in
``.cache/pythons/<minor>`` (packaging, and importlib-metadata for 3.8/3.9) is cloned and
the wheel is installed into the clone with pip, so the real ``mcore_autopatch.pth`` runs
at startup. The scripts never import mcore_autopatch themselves.
"""

import json
import os
import subprocess
from typing import Any, Dict

import envs
import pytest
from conftest import clean_env, run_python
from fakes import FAKE_MEGATRON, FAKE_TORCH

WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"

# The finders this interpreter has, and which of our modules startup loaded.
FINDERS = r"""
import json, sys
finders = [type(f).__name__ for f in sys.meta_path if getattr(type(f), "_mcore_autopatch_finder", False)]
loaded = sorted(m for m in sys.modules if m.startswith("mcore_autopatch"))
if len(sys.argv) > 1:  # process the installed .pth a second time, as a venv may (gh-75723)
    with open(sys.argv[1]) as f:
        for line in f:
            if line.startswith("import"):
                exec(line)
    finders = [type(f).__name__ for f in sys.meta_path if getattr(type(f), "_mcore_autopatch_finder", False)]
print(json.dumps({"finders": finders, "loaded": loaded}))
"""

# Import the fake writer, reload it, delete and re-import it; call it like megatron-core
# 0.12 each time and report what the fake torch received.
HOOK = r"""
import importlib, io, json, sys

NAME = "megatron.core.dist_checkpointing.strategies.filesystem_async"
from torch.distributed.checkpoint import filesystem as fs


class FakeWriterTransforms:
    # FAKE: stands in for the transforms object a megatron-core 0.12 writer holds.
    def transform_save_stream(self, write_item, stream):
        return stream, []


def probe(writer):
    function, levels = writer._write_item, 0
    while getattr(function, "__mcore_autopatch__", False):
        levels, function = levels + 1, function.__wrapped__
    del fs.FAKE_CALLS[:]
    try:
        result = writer.fake_call_like_0_12(FakeWriterTransforms(), io.BytesIO(), "d", "item", "key")
        last = fs.FAKE_CALLS[-1]
        call = {"ok": True, "positional": len(last.args), "keywords": {k: str(v) for k, v in last.kwargs.items()},
                "tensor_bytes": result.tensor_bytes_written}
    except TypeError as exc:
        call = {"ok": False, "error": str(exc)}
    return {"levels": levels, "reaches_fake_torch": function is fs._write_item, "call": call}


first = importlib.import_module(NAME)
out = {"import": probe(first)}
reloaded = importlib.reload(first)
out["reload"] = probe(reloaded)
del sys.modules[NAME]
again = importlib.import_module(NAME)
out["reimport"] = probe(again)
out["reimport_is_new_module"] = again is not first
out["finders"] = sum(1 for f in sys.meta_path if getattr(type(f), "_mcore_autopatch_finder", False))
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=envs.OTHER_PYTHONS)
def other_python(request: Any, wheel_path: str, tmp_path_factory: Any) -> str:
    """A clone of ``.cache/pythons/<minor>`` with the wheel installed by pip."""
    minor = request.param
    source = envs.python_venv_folder(minor)
    if not os.path.exists(envs.venv_python(source)):
        pytest.skip("CPython %s venv missing (.cache/pythons/%s): run `python3 tools/envs.py pythons`" % (minor, minor))
    python = envs.clone_venv(source, str(tmp_path_factory.mktemp("py" + minor) / "venv"))
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", wheel_path],
        check=True,
        capture_output=True,
    )
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True)
    assert version.stdout.decode().strip() == minor
    return python


def fake_env(**extra: Any) -> Dict[str, str]:
    # No bytecode written into tests/fakes by other interpreters.
    return clean_env(PYTHONPATH=os.pathsep.join([FAKE_MEGATRON, FAKE_TORCH]), PYTHONDONTWRITEBYTECODE="1", **extra)


def run_json(python: str, args: Any, env: Dict[str, str]) -> Dict[str, Any]:
    proc = run_python(python, args, env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return json.loads(proc.stdout)


@pytest.mark.parametrize("log", [None, "debug"])
def test_python_c_pass_prints_nothing_and_exits_0(other_python, log):
    """The .pth runs in every interpreter: it must be silent, even with debug logging asked for."""
    proc = run_python(other_python, ["-c", "pass"], fake_env(MCORE_AUTOPATCH_LOG=log), timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_pth_installs_exactly_one_finder_silently(other_python):
    """Startup loads only the stdlib-only package __init__ and puts one finder on sys.meta_path."""
    info = run_json(other_python, ["-c", FINDERS], fake_env())
    assert info == {"finders": ["_Finder"], "loaded": ["mcore_autopatch"]}


def test_pth_processed_twice_still_installs_one_finder(other_python):
    purelib = subprocess.run(
        [other_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    pth = os.path.join(purelib, "mcore_autopatch.pth")
    assert os.path.isfile(pth)
    info = run_json(other_python, ["-c", FINDERS, pth], fake_env())
    assert info["finders"] == ["_Finder"]


def test_hook_fires_on_import_reload_and_reimport_with_one_wrapper(other_python):
    """Each execution of the writer's body is fixed again: serialization_format reaches torch."""
    info = run_json(other_python, ["-c", HOOK], fake_env())
    for when in ("import", "reload", "reimport"):
        assert info[when]["levels"] == 1, (when, info)
        assert info[when]["reaches_fake_torch"] is True, (when, info)
        assert info[when]["call"] == {
            "ok": True,
            "positional": 5,
            "keywords": {"serialization_format": "FakeSerializationFormat.TORCH_SAVE"},
            "tensor_bytes": True,
        }, (when, info)
    assert info["reimport_is_new_module"] is True
    assert info["finders"] == 1


def test_mode_off_patches_nothing_and_the_bug_shows(other_python):
    """MCORE_AUTOPATCH=0: no finder, torch's function untouched, the 0.12 call fails as it does upstream."""
    info = run_json(other_python, ["-c", HOOK], fake_env(MCORE_AUTOPATCH="0"))
    assert info["finders"] == 0
    for when in ("import", "reload", "reimport"):
        assert info[when]["levels"] == 0
        assert info[when]["call"]["ok"] is False
        assert "missing 1 required positional argument: 'serialization_format'" in info[when]["call"]["error"]


def test_writer_module_loads_as_it_would_without_the_hook(other_python):
    """The real loader is back on the module after the import; its source is readable."""
    script = (
        "import inspect, json, importlib; m = importlib.import_module(%r); "
        "print(json.dumps({'loader': type(m.__loader__).__name__, 'spec_loader': type(m.__spec__.loader).__name__, "
        "'source': 'fake_call_like_0_12' in inspect.getsource(m)}))" % WRITER
    )
    info = run_json(other_python, ["-c", script], fake_env())
    assert info == {"loader": "SourceFileLoader", "spec_loader": "SourceFileLoader", "source": True}


# The bytecode reading of keep_mcore_data on each minor: which attributes a function assigns.
ATTRIBUTE_STORES = r"""
import json
from mcore_autopatch.fixes import keep_mcore_data


class FakePlanner:  # FAKE: the shape of megatron-core 0.8-0.14's MCoreSavePlanner
    def create_global_plan(self, all_plans):
        metadata = type("FakeMetadata", (), {})()
        metadata.mcore_data = dict((p.key, p.mcore_data) for p in all_plans)  # stored; p.mcore_data only read
        return all_plans, metadata


def fake_saver(all_local_plans):  # FAKE: the shape of megatron-core's save_state_dict_async_plan
    global_metadata = type("FakeMetadata", (), {})()
    global_metadata.all_local_plans = all_local_plans
    return global_metadata


def fake_reader_only(metadata):  # FAKE: reads the attributes, stores neither
    return metadata.mcore_data, getattr(metadata, "all_local_plans", None)


print(json.dumps([sorted(keep_mcore_data.stored_attributes(f)) for f in
                  (FakePlanner.create_global_plan, fake_saver, fake_reader_only)]))
"""


def test_attribute_stores_are_read_from_bytecode_on_every_minor(other_python):
    proc = run_python(other_python, ["-c", ATTRIBUTE_STORES], clean_env())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [["mcore_data"], ["all_local_plans"], []]


# code_reading's reading of `<global>.<attribute>` loads (with dis) on each minor, on code of
# known answers: comprehensions (inlined from 3.12), closures, methods, a local of the same
# name, an attribute chain, and EXTENDED_ARG (a name index past 255).
ATTRIBUTE_LOADS = r"""
import json, types
from mcore_autopatch.shared import code_reading

BODY = "; ".join("obj.name%d" % i for i in range(300))
SOURCE = (
    "np = None\n"
    "def direct(shape):\n    return np.product(shape)\n"
    "def in_comprehension(flags):\n    return [np.alltrue(f) for f in flags]\n"
    "def renamed_upstream(shape):\n    return np.prod(shape)\n"
    "def a_local_of_that_name(np):\n    return np.product(1)\n"
    "def in_closure(x):\n    def inner():\n        return np.sometrue(x)\n    return inner\n"
    "class Holder:\n    def method(self):\n        return np.cumproduct(1)\n"
    "def through_another_object(obj):\n    return obj.np.product(1)\n"
    "def past_255_names(obj):\n    " + BODY + "\n    return np.product(1)\n"
)
module = types.ModuleType("fake_numpy_caller", "FAKE: a megatron-core-like module made here")
exec(compile(SOURCE, "fake_numpy_caller.py", "exec"), vars(module))
wanted = frozenset(("product", "cumproduct", "alltrue", "sometrue"))
found = {}
for qualname, code in code_reading.defined_functions(module):
    found[qualname] = sorted(code_reading.attributes_loaded(code, frozenset(["np"]), wanted))
print(json.dumps(found, sort_keys=True))
"""

ATTRIBUTE_LOADS_EXPECTED = {
    "direct": ["product"],
    "in_comprehension": ["alltrue"],
    "renamed_upstream": [],
    "a_local_of_that_name": [],
    "in_closure": ["sometrue"],
    "Holder.method": ["cumproduct"],
    "through_another_object": [],
    "past_255_names": ["product"],
}


def test_attribute_loads_are_read_with_dis_on_every_minor(other_python):
    proc = run_python(other_python, ["-c", ATTRIBUTE_LOADS], clean_env())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ATTRIBUTE_LOADS_EXPECTED
