"""Units of the fixes for the stack around megatron-core (numpy 2, torch's weights_only default,
torch 2.4's planning of ShardedObjects), on modules named FAKE that stand in for the shapes of
code they read; tests/test_e2e_fresh_stack.py runs them on the real releases.

Each fix rebinds one global (or one method) of megatron-core's own code: the tests check what
is read, that the rebinding holds only there, and that the real module stays untouched.
"""

import functools
import io
import textwrap
import types
from typing import Any, Dict, List

import pytest

from mcore_autopatch import fixes
from mcore_autopatch.fixes import numpy_removed_names, sharded_objects_planned_once, torch_load_weights_only
from mcore_autopatch.shared import code_reading, standin, versions


def fake_module(name: str, source: str, **globals_: Any) -> types.ModuleType:
    """A module named ``name`` whose functions are defined by ``source`` (so they are its own)."""
    module = types.ModuleType(name, "FAKE module (tests/test_stack_fixes.py)")
    vars(module).update(globals_)
    exec(compile(textwrap.dedent(source), "<fake %s>" % name, "exec"), vars(module))
    return module


@pytest.fixture(autouse=True)
def megatron_version(monkeypatch):
    fake = versions.WriterVersion("0.12.1", (0, 12, 1), "metadata")
    monkeypatch.setattr(versions, "writer_version", lambda writer: fake)


# --- reading code -------------------------------------------------------------------------------

READ_ME = """
    import functools

    def plain(shape):
        return np.product(shape)

    def nested(shapes):
        return [np.product(s) for s in shapes]

    def lambda_inside(shapes):
        return sorted(shapes, key=lambda s: np.cumproduct(s)[-1])

    def other_owner(obj):
        return obj.product(3), self_product(np)

    def shadowed(np):
        return np.product(2)

    def self_product(x):
        return x

    class Holder:
        def method(self):
            return np.alltrue([True])

        @staticmethod
        def static():
            return np.sometrue([False])

        @property
        def prop(self):
            return np.product([2, 3])

    def decorator(f):
        @functools.wraps(f)
        def wrapper(*a, **k):
            return f(*a, **k)
        return wrapper

    @decorator
    def wrapped(shape):
        return np.product(shape)

    def loads(path):
        return torch.load(path, map_location="cpu")

    def loads_with_keyword(path):
        return torch.load(path, map_location="cpu", weights_only=False)
"""
WANTED = frozenset(numpy_removed_names.REPLACEMENTS)


def loaded_by(module: types.ModuleType) -> Dict[str, Any]:
    return {
        name: code_reading.attributes_loaded(code, frozenset(("np",)), WANTED)
        for name, code in code_reading.defined_functions(module)
    }


def test_attributes_loaded_reads_global_attribute_loads_in_every_kind_of_function():
    found = loaded_by(fake_module("fake.reading", READ_ME, np=object(), torch=object()))
    assert found["plain"] == {"product"}
    assert found["nested"] == {"product"}  # in a comprehension
    assert found["lambda_inside"] == {"cumproduct"}  # in a lambda
    assert found["Holder.method"] == {"alltrue"}
    assert found["Holder.static"] == {"sometrue"}
    assert found["Holder.prop"] == {"product"}  # a property's getter
    assert found["wrapped"] == {"product"}  # through functools.wraps
    assert found["other_owner"] == frozenset()  # obj.product is not numpy's
    assert found["shadowed"] == frozenset()  # a parameter named np is not the global


def test_mentions_has_keyword_argument_names_and_defined_functions_skip_imported_ones():
    module = fake_module("fake.reading", READ_ME, np=object(), torch=object(), imported=functools.partial)
    codes = dict(code_reading.defined_functions(module))
    assert "weights_only" in code_reading.mentions(codes["loads_with_keyword"])
    assert "weights_only" not in code_reading.mentions(codes["loads"])
    assert "imported" not in codes and "decorator" in codes


# --- the stand-in --------------------------------------------------------------------------------


def test_stand_in_is_the_real_module_but_for_its_overrides_and_the_real_one_is_untouched():
    real = types.ModuleType("fakenumpy", "FAKE numpy")
    real.prod = lambda x: "prod"  # type: ignore[attr-defined]
    namespace: Dict[str, Any] = {"np": real}
    assert standin.rebind(namespace, "np", real, {"product": real.prod}, "product is prod") is None
    stand_in = namespace["np"]
    assert stand_in.product is real.prod and stand_in.prod is real.prod
    assert not hasattr(real, "product")
    real.added_later = 1  # type: ignore[attr-defined]
    assert stand_in.added_later == 1  # looked up at each use
    assert standin.real_module(stand_in) is real and standin.overrides(stand_in) == ("product",)
    assert "product is prod" in repr(stand_in) and "product" in dir(stand_in)


def test_stand_in_keeps_earlier_overrides_and_refuses_a_global_that_is_not_the_module():
    real = types.ModuleType("fakenumpy", "FAKE numpy")
    namespace: Dict[str, Any] = {"np": real}
    standin.rebind(namespace, "np", real, {"product": 1}, "first")
    standin.rebind(namespace, "np", real, {"cumproduct": 2}, "second")
    assert (namespace["np"].product, namespace["np"].cumproduct) == (1, 2)
    shim = object()
    namespace = {"np": shim}
    refused = standin.rebind(namespace, "np", real, {"product": 1}, "why")
    assert refused and refused.startswith("np is already") and namespace["np"] is shim


# --- numpy_removed_names ---------------------------------------------------------------------------


def fake_numpy(version: str, has_product: bool) -> types.ModuleType:
    numpy = types.ModuleType("numpy", "FAKE numpy %s" % version)
    numpy.__version__ = version  # type: ignore[attr-defined]
    numpy.prod = lambda values: functools.reduce(lambda a, b: a * b, values, 1)  # type: ignore[attr-defined]
    numpy.cumprod, numpy.all, numpy.any = (lambda v: v), all, any  # type: ignore[attr-defined]
    if has_product:  # numpy 1.x still has every alias numpy 2 removed
        numpy.product, numpy.cumproduct = numpy.prod, numpy.cumprod  # type: ignore[attr-defined]
        numpy.alltrue, numpy.sometrue = all, any  # type: ignore[attr-defined]
    return numpy


VALIDATION = """
    def _validate_sharding_for_key_flattened(shape):
        return np.product(shape)

    def unrelated():
        return np.zeros(3)
"""


def test_numpy_fix_gives_the_removed_name_to_that_module_only(monkeypatch):
    numpy = fake_numpy("2.4.6", has_product=False)
    monkeypatch.setitem(__import__("sys").modules, "numpy", numpy)
    module = fake_module("megatron.core.dist_checkpointing.validation", VALIDATION, np=numpy)
    other = fake_module("megatron.core.dist_checkpointing.mapping", "def f():\n    return np.prod([2])\n", np=numpy)
    ev = numpy_removed_names.evaluate(module, "auto")
    assert ev.decision.needed is True
    assert ev.missing == ("product",) and ev.callers == ("_validate_sharding_for_key_flattened",)
    assert ev.decision.reason.startswith("megatron-core 0.12.1 calls numpy.product, which numpy 2.4.6 no longer has")
    assert ev.decision.where == "dist_checkpointing.validation: _validate_sharding_for_key_flattened"
    _decision, applied = numpy_removed_names.apply(module, "auto")
    assert applied and numpy_removed_names.is_applied(module)
    assert module._validate_sharding_for_key_flattened((2, 3, 4)) == 24
    assert not hasattr(numpy, "product")  # numpy itself is untouched
    assert other.np is numpy and numpy_removed_names.evaluate(other, "auto").decision.needed is False
    first = module.np
    numpy_removed_names.apply(module, "auto")
    assert module.np is first  # a second look changes nothing


def test_numpy_fix_is_not_needed_on_numpy_1(monkeypatch):
    numpy = fake_numpy("1.26.4", has_product=True)
    monkeypatch.setitem(__import__("sys").modules, "numpy", numpy)
    module = fake_module("megatron.core.dist_checkpointing.validation", VALIDATION, np=numpy)
    decision, applied = numpy_removed_names.apply(module, "auto")
    assert (decision.needed, applied) == (False, False)
    assert module.np is numpy
    assert "numpy 1.26.4 has every name its checkpointing code calls" in decision.reason


def test_numpy_fix_leaves_a_jobs_own_numpy_shim_alone(monkeypatch):
    numpy = fake_numpy("2.4.6", has_product=False)
    monkeypatch.setitem(__import__("sys").modules, "numpy", numpy)
    module = fake_module("megatron.core.dist_checkpointing.validation", VALIDATION, np=numpy)
    shim = standin.ModuleStandIn(numpy, {"zeros": None}, "a FAKE shim of a job's")
    module.np = types.SimpleNamespace(product=numpy.prod)  # FAKE: a job's own np, not numpy
    decision, applied = numpy_removed_names.apply(module, "auto")
    assert decision.needed is False and not applied  # its np is not numpy: nothing of ours to do
    module.np = shim
    decision, applied = numpy_removed_names.apply(module, "auto")
    assert applied and module.np.product is numpy.prod and module.np.zeros is None  # the shim's own kept


# --- torch_load_weights_only -------------------------------------------------------------------------


class FakeTorch(types.ModuleType):
    """FAKE torch: ``load`` records its keyword arguments; ``serialization`` says the default."""

    def __init__(self, version: str, default_weights_only: Any) -> None:
        super().__init__("torch", "FAKE torch %s" % version)
        self.__version__ = version
        self.calls: List[Dict[str, Any]] = []
        self.serialization = types.SimpleNamespace()
        if default_weights_only is not None:
            self.serialization._default_to_weights_only = lambda pickle_module: default_weights_only

    def load(self, f: Any, map_location: Any = None, **kwargs: Any) -> Any:
        self.calls.append(dict(kwargs, map_location=map_location))
        return "loaded"


COMMON = """
    class TorchCommonLoadStrategy:
        def load_common(self, path):
            return torch.load(path, map_location="cpu")

        def load_sharded_objects(self, path):
            return torch.load(path)

    def newer_release(path):
        return torch.load(path, weights_only=False)
"""


def test_weights_only_fix_restores_the_whole_pickle_for_that_modules_calls_only(monkeypatch):
    torch = FakeTorch("2.13.0", default_weights_only=True)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    module = fake_module("megatron.core.dist_checkpointing.strategies.common", COMMON, torch=torch)
    ev = torch_load_weights_only.evaluate(module, "auto")
    assert ev.decision.needed is True
    assert ev.callers == ("TorchCommonLoadStrategy.load_common", "TorchCommonLoadStrategy.load_sharded_objects")
    assert "torch 2.13.0 loads with weights_only=True unless told otherwise" in ev.decision.reason
    _decision, applied = torch_load_weights_only.apply(module, "auto")
    assert applied and torch_load_weights_only.is_applied(module)
    module.TorchCommonLoadStrategy().load_common("common.pt")
    module.newer_release("x.pt")
    torch.load("elsewhere.pt")  # torch itself: unchanged
    assert torch.calls == [
        {"weights_only": False, "map_location": "cpu"},
        {"weights_only": False, "map_location": None},
        {"map_location": None},
    ]
    assert module.torch.__version__ == "2.13.0" and module.torch.load is not torch.load


@pytest.mark.parametrize(
    "default,environment,needed,words",
    [
        (None, {}, False, "loads the whole pickle unless told otherwise"),  # torch <= 2.5
        (False, {}, False, "weights_only=False unless told otherwise"),
        (True, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, False, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set"),
        (True, {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}, None, "applies whatever a call passes: not patching"),
    ],
)
def test_weights_only_fix_follows_what_torch_does_with_a_call_without_it(
    monkeypatch, default, environment, needed, words
):
    torch = FakeTorch("2.x", default_weights_only=default)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    for name in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    module = fake_module("megatron.core.dist_checkpointing.strategies.common", COMMON, torch=torch)
    decision, applied = torch_load_weights_only.apply(module, "auto")
    assert (decision.needed, applied) == (needed, False)
    assert words in decision.reason
    assert module.torch is torch


@pytest.mark.parametrize("allowlist_imported", [False, True], ids=["allowlist-not-imported-yet", "allowlist-imported"])
def test_weights_only_fix_decides_a_release_with_its_own_allowlist_the_same_in_any_import_order(
    monkeypatch, tmp_path, allowlist_imported
):
    """megatron-core 0.14+ (FAKE package with a safe_globals.py beside its __init__): the hook runs
    while ``import megatron.core`` has not reached its allowlist yet, ``status`` runs after; both
    read the same files, so both say needed, and name the allowlist."""
    torch = FakeTorch("2.13.0", default_weights_only=True)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    package = types.ModuleType("megatron.core")
    package.__path__ = [str(tmp_path)]  # type: ignore[attr-defined]
    (tmp_path / "safe_globals.py").write_text("# FAKE: megatron-core 0.14's allowlist module\n")
    monkeypatch.setitem(__import__("sys").modules, "megatron.core", package)
    if allowlist_imported:
        fake = types.ModuleType("FAKE")
        monkeypatch.setitem(__import__("sys").modules, torch_load_weights_only.OWN_ALLOWLIST_MODULE, fake)
    else:
        monkeypatch.delitem(__import__("sys").modules, torch_load_weights_only.OWN_ALLOWLIST_MODULE, raising=False)
    module = fake_module("megatron.core.dist_checkpointing.strategies.common", COMMON, torch=torch)
    assert fixes.ruled_out(fixes.by_name("torch_load_weights_only"), module) is None
    decision, applied = torch_load_weights_only.apply(module, "auto")
    assert (decision.needed, applied) == (True, True)
    assert "its own allowlist, megatron.core.safe_globals" in decision.reason


# --- sharded_objects_planned_once ---------------------------------------------------------------------


class FakeItem:
    def __init__(self, fqn: str) -> None:
        self.index = types.SimpleNamespace(fqn=fqn)


def fake_torch_planner(every_rank: bool) -> types.ModuleType:
    """FAKE torch.distributed.checkpoint.default_planner: plans BytesIO values on every rank
    (torch >= 2.4) or on the coordinator only (torch <= 2.3)."""
    module = types.ModuleType(sharded_objects_planned_once.TORCH_PLANNER_MODULE, "FAKE default_planner")

    def create_default_local_save_plan(state_dict: Dict[str, Any], is_coordinator: bool) -> Any:
        items = [
            FakeItem(k) for k, v in state_dict.items() if every_rank or is_coordinator or not isinstance(v, io.BytesIO)
        ]
        return types.SimpleNamespace(items=items)

    module.create_default_local_save_plan = create_default_local_save_plan  # type: ignore[attr-defined]
    return module


PLANNER = """
    class MCoreSavePlanner:  # FAKE megatron-core 0.6-0.8
        is_coordinator = False

        def __init__(self, state_dict):
            self.state_dict = state_dict

        def create_local_plan(self):
            plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
            self._add_non_coordinator_iobytes_request(plan)
            return plan

        def _add_non_coordinator_iobytes_request(self, plan):
            if self.is_coordinator:
                return
            for fqn, obj in self.state_dict.items():
                if isinstance(obj, io.BytesIO):
                    plan.items.append(FakeItem(fqn))
"""


@pytest.mark.parametrize("every_rank", [True, False])
def test_planner_fix_plans_each_sharded_object_once(monkeypatch, every_rank):
    torch_planner = fake_torch_planner(every_rank)
    monkeypatch.setitem(__import__("sys").modules, sharded_objects_planned_once.TORCH_PLANNER_MODULE, torch_planner)
    module = fake_module(
        "megatron.core.dist_checkpointing.strategies.torch",
        PLANNER,
        io=io,
        FakeItem=FakeItem,
        create_default_local_save_plan=torch_planner.create_default_local_save_plan,
    )
    state = {"rng_state/shard_0_1": io.BytesIO(), "weight": object()}
    before = [item.index.fqn for item in module.MCoreSavePlanner(state).create_local_plan().items]
    decision, applied = sharded_objects_planned_once.apply(module, "auto")
    after = [item.index.fqn for item in module.MCoreSavePlanner(state).create_local_plan().items]
    assert (decision.needed, applied) == (every_rank, every_rank)
    assert sorted(after) == ["rng_state/shard_0_1", "weight"]  # each once, whichever torch
    assert before.count("rng_state/shard_0_1") == (2 if every_rank else 1)


# --- the table ---------------------------------------------------------------------------------------


def test_combine_states_each_reason_once_with_where_it_holds():
    rows = [
        {"needed": True, "applied": True, "reason": "calls numpy.product", "where": "validation: f"},
        {"needed": True, "applied": True, "reason": "calls numpy.product", "where": "mapping: g"},
        {"needed": False, "applied": False, "reason": "has none", "where": "serialization"},
    ]
    assert fixes.combine(rows) == {
        "needed": True,
        "applied": True,
        "reason": "calls numpy.product (in validation: f; mapping: g)",
    }
    rows[1]["applied"] = False
    assert fixes.combine(rows)["applied"] is False  # every module that needs it must have it
    assert fixes.combine([]) is None


def test_skip_names_fixes_and_a_skipped_fix_is_read_but_not_applied(monkeypatch):
    monkeypatch.setenv(fixes.SKIP_ENV, "torch_load_weights_only, numpy_removed_names")
    assert fixes.skipped_names() == {"torch_load_weights_only", "numpy_removed_names"}
    assert fixes.is_skipped(fixes.by_name("numpy_removed_names"))
    assert not fixes.is_skipped(fixes.by_name("write_item"))


def test_gates_know_what_the_implementations_know():
    """The table rules a fix out without importing it; what it checks must be what the fix reads."""
    assert set(fixes.REMOVED_BY_NUMPY_2) == set(numpy_removed_names.REPLACEMENTS)
    assert "_add_non_coordinator_iobytes_request" == sharded_objects_planned_once.METHOD
    assert fixes.by_name("torch_load_weights_only").gate
    assert [f.name for f in fixes.FIXES if f.acts_while_executing] == ["pkg_resources_packaging"]


def test_weights_only_gate_lets_a_bare_load_through_and_rules_out_a_release_that_names_it(monkeypatch):
    """0.6 - 0.10 (a load without weights_only) go on to the fix; 0.11+ are ruled out by names alone,
    and so is a module whose loads never go through torch (0.11+'s serialization.load calls the
    strategy's load)."""
    torch = FakeTorch("2.13.0", True)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    old = fake_module("megatron.core.dist_checkpointing.strategies.common", COMMON, torch=torch)
    assert fixes._megatron_may_load_without_weights_only(old) is None
    newer = fake_module(
        "megatron.core.dist_checkpointing.strategies.common",
        "def load_common(path):\n    return torch.load(path, weights_only=False)\n",
        torch=torch,
    )
    assert fixes._megatron_may_load_without_weights_only(newer) == (
        "megatron-core passes weights_only wherever its code here calls torch's load"
    )
    through_a_strategy = fake_module(
        "megatron.core.dist_checkpointing.serialization",
        "def load(strategy, path):\n    return strategy.load(path)\n",
        torch=torch,
    )
    assert fixes._megatron_may_load_without_weights_only(through_a_strategy) == (
        "megatron-core passes weights_only wherever its code here calls torch's load"
    )
    without_torch = fake_module("megatron.core.dist_checkpointing.serialization", "def load(path):\n    pass\n")
    assert fixes._megatron_may_load_without_weights_only(without_torch) == (
        "megatron-core's code here does not hold torch"
    )
    # Once our stand-in holds torch's place (an earlier execution), the gate still lets it through.
    torch_load_weights_only.apply(old, "auto")
    assert type(old.torch).__name__ == "ModuleStandIn"
    assert fixes._megatron_may_load_without_weights_only(old) is None


def test_a_gated_fix_is_not_imported_where_it_cannot_act(monkeypatch):
    """numpy 1.x: the numpy fix's module is never imported, and the hook records why."""
    import sys

    monkeypatch.setitem(sys.modules, "numpy", fake_numpy("1.26.4", has_product=True))
    monkeypatch.delitem(sys.modules, "mcore_autopatch.fixes.numpy_removed_names", raising=False)
    monkeypatch.setattr(fixes, "_state", fixes._fresh_state())
    module = fake_module("megatron.core.dist_checkpointing.validation", VALIDATION, np=sys.modules["numpy"])
    fixes.run(fixes.by_name("numpy_removed_names"), module, "auto")
    assert "mcore_autopatch.fixes.numpy_removed_names" not in sys.modules
    assert fixes.last_decision(fixes.by_name("numpy_removed_names")) == {
        "needed": False,
        "applied": False,
        "reason": "numpy 1.26.4 has every name numpy 2 removed (in dist_checkpointing.validation)",
    }


def test_pkg_resources_gate_reads_the_source_before_the_body_runs(tmp_path, monkeypatch):
    """A module whose source never names pkg_resources is ruled out without importing the fix;
    one that names it, or whose source cannot be read, goes on to the window."""
    import importlib.util
    import sys

    monkeypatch.delitem(sys.modules, "pkg_resources", raising=False)

    def unexecuted(source: str, name: str = "random.py") -> types.ModuleType:
        path = tmp_path / name
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("megatron.core.tensor_parallel.random", path)
        return importlib.util.module_from_spec(spec)  # as the hook's before-callback sees it

    gate = fixes._pkg_resources_may_lack_packaging
    assert gate(unexecuted("from pkg_resources import packaging\n")) is None
    assert gate(unexecuted("import torch\n", "newer.py")) == "megatron-core's source here never names pkg_resources"
    assert gate(types.ModuleType("megatron.core.tensor_parallel.random")) is None  # no file to read
    gone = unexecuted("import torch\n", "gone.py")
    (tmp_path / "gone.py").unlink()
    assert gate(gone) is None
    with_packaging = types.ModuleType("FAKE pkg_resources")
    with_packaging.packaging = object()
    monkeypatch.setitem(sys.modules, "pkg_resources", with_packaging)
    assert gate(unexecuted("from pkg_resources import packaging\n")) == (
        "the pkg_resources imported here provides packaging"
    )


def test_attribute_loads_are_read_with_dis_on_this_python():
    """The other minors run the same script in tests/test_other_pythons.py."""
    import json
    import subprocess
    import sys

    from conftest import ROOT
    from test_other_pythons import ATTRIBUTE_LOADS, ATTRIBUTE_LOADS_EXPECTED

    proc = subprocess.run(
        [sys.executable, "-c", ATTRIBUTE_LOADS], capture_output=True, text=True, env={"PYTHONPATH": ROOT}, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ATTRIBUTE_LOADS_EXPECTED


def test_defined_functions_passes_over_instances_the_module_defines():
    """An enum member (or any instance whose class is the module's) has a __module__ but no
    __name__: it is not code, and reading the module must not stop there."""
    module = fake_module(
        "megatron.core.dist_checkpointing.fake_enums",
        "import enum\nclass Kind(enum.Enum):\n    A = 1\nDEFAULT = Kind.A\ndef load_it(path):\n    return path\n",
    )
    names = [name for name, _code in code_reading.defined_functions(module)]
    assert "load_it" in names and not any(name.startswith("DEFAULT") for name in names)


@pytest.mark.parametrize(
    "source,ruled_out",
    [
        ("import numpy as np\ndef size(shape):\n    return np.product(shape)\n", False),
        ("import numpy as np\ndef every(flags):\n    return np.alltrue(flags)\n", False),
        ("import numpy as np\ndef size(shape):\n    return np.prod(shape)\n", True),  # 0.12.1's serialization
    ],
    ids=["product", "alltrue", "none-named"],
)
def test_numpy_gate_on_numpy_2_reads_the_source_for_the_removed_names(tmp_path, monkeypatch, source, ruled_out):
    import importlib.util
    import sys

    monkeypatch.setitem(sys.modules, "numpy", fake_numpy("2.4.6", has_product=False))
    path = tmp_path / "validation.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("megatron.core.dist_checkpointing.validation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gated = fixes._numpy_lacks_a_removed_name(module)
    assert (gated == "megatron-core's source here never names what numpy 2 removed") is ruled_out
    assert ruled_out or gated is None
