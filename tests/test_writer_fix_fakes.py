"""The safe ``_write_item`` and its rebinding, against FAKE torch generations.

torch 2.6, 2.7 and 2.8 cannot be installed here side by side; the recorded fakes of
``tests/fakes/fake_torch_write_items.py`` stand in for their ``_write_item`` and report
exactly which positional and keyword arguments each call carried. The writer module is a
plain ``types.ModuleType`` with a ``_write_item`` global, as megatron-core's is; torch's
filesystem module is a fake put into ``sys.modules`` by the ``fake`` fixture, and the
megatron-core version comes from a FAKE megatron-core tree on ``sys.path``. Each fix is
shown failing first without the safe caller.
"""

import io
import itertools
import logging
import sys
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
from fakes import fake_megatron_tree
from fakes import fake_torch_write_items as fake_torch

import mcore_autopatch
from mcore_autopatch import fixes
from mcore_autopatch.fixes import write_item
from mcore_autopatch.shared import versions

TS = fake_torch.FakeSerializationFormat.TORCH_SAVE
SAFETENSORS = fake_torch.FakeSerializationFormat.SAFETENSORS
TORCH_FS = "torch.distributed.checkpoint.filesystem"
TORCH_MODULES = ("torch", "torch.distributed", "torch.distributed.checkpoint", TORCH_FS)


class FakeTorch:
    """Puts a FAKE torch filesystem module of one generation into ``sys.modules``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.fs: Optional[types.ModuleType] = None
        for name in TORCH_MODULES:
            monkeypatch.delitem(sys.modules, name, raising=False)
        del fake_torch.FAKE_CALLS[:]

    @property
    def calls(self) -> List[fake_torch.FakeCall]:
        return fake_torch.FAKE_CALLS

    def install(
        self,
        generation: str = "2.8",
        fake_write_item: Optional[Callable[..., Any]] = None,
        without: Tuple[str, ...] = (),
    ) -> types.ModuleType:
        torch = types.ModuleType("torch", "FAKE torch (tests/test_writer_fix_fakes.py)")
        torch.__version__ = "%s.0+fake" % generation  # type: ignore[attr-defined]
        fs = types.ModuleType(TORCH_FS, "FAKE torch filesystem module, generation %s" % generation)
        fs._write_item = fake_write_item or fake_torch.FAKE_GENERATIONS[generation]  # type: ignore[attr-defined]
        for name in fake_torch.FAKE_GENERATION_EXTRAS[generation]:
            setattr(fs, name, fake_torch.FAKE_EXTRA_OBJECTS[name])
        for name in without:
            delattr(fs, name)
        modules = [torch, types.ModuleType("torch.distributed"), types.ModuleType("torch.distributed.checkpoint"), fs]
        for module in modules:
            self.monkeypatch.setitem(sys.modules, module.__name__, module)
        self.fs = fs
        return fs

    def block_import(self) -> None:
        """Make ``import torch.distributed.checkpoint.filesystem`` raise ImportError."""
        for name in TORCH_MODULES:
            self.monkeypatch.setitem(sys.modules, name, None)

    def writer(self) -> types.ModuleType:
        """A fresh FAKE writer module whose ``_write_item`` global is torch's, as after its import."""
        writer = types.ModuleType(mcore_autopatch.WRITER_MODULE, "FAKE megatron-core writer module")
        writer._write_item = getattr(self.fs, "_write_item", None)  # type: ignore[attr-defined]
        return writer


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTorch]:
    """FAKE torch modules in ``sys.modules`` for one test; the real entries come back after."""
    monkeypatch.setattr(fixes, "_state", fixes._fresh_state())
    monkeypatch.delenv("MCORE_AUTOPATCH", raising=False)
    yield FakeTorch(monkeypatch)
    del fake_torch.FAKE_CALLS[:]


@pytest.fixture
def fake_megatron(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[Callable[[str], str]]:
    """Put a FAKE megatron-core tree of one version first on ``sys.path``."""

    def megatron_modules() -> List[str]:
        return [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]

    def put(version: str) -> str:
        folder = fake_megatron_tree(str(tmp_path / ("fake-megatron-%s" % version)), version=version)
        monkeypatch.syspath_prepend(folder)
        return folder

    for name in megatron_modules():
        monkeypatch.delitem(sys.modules, name)
    yield put
    for name in megatron_modules():
        del sys.modules[name]


# --- calls as megatron-core makes them ----------------------------------------------------


class Args:
    """One set of arguments a writer passes, with the writer's own transforms object."""

    def __init__(self) -> None:
        self.transforms = fake_torch.FakeStorageWriterTransforms()
        self.stream = io.BytesIO()
        self.data = "fake-tensor-data"
        self.write_item = "fake-write-item"
        self.storage_key = "fake-storage-key"

    @property
    def legacy(self) -> Tuple[Any, ...]:
        return (self.stream, self.data, self.write_item, self.storage_key)


SHAPES: Dict[str, Callable[[Args], Tuple[Tuple[Any, ...], Dict[str, Any]]]] = {
    "0.9-0.11 (4 positional)": lambda a: (a.legacy, {}),
    "0.12 (transforms + 4)": lambda a: ((a.transforms, *a.legacy), {}),
    "0.13 (5 + serialization_format=)": lambda a: ((a.transforms, *a.legacy), {"serialization_format": TS}),
    "job shim (6 positional)": lambda a: ((a.transforms, *a.legacy, TS), {}),
}
# (generation, shape) -> what the safe caller built from the force plan must pass on:
# (prepends transforms, adds serialization_format=TORCH_SAVE)
FORCE_MATRIX = {
    ("2.7", "0.9-0.11 (4 positional)"): (True, False),
    ("2.7", "0.12 (transforms + 4)"): (False, False),
    ("2.7", "0.13 (5 + serialization_format=)"): (False, False),
    ("2.7", "job shim (6 positional)"): (False, False),
    ("2.8", "0.9-0.11 (4 positional)"): (True, True),
    ("2.8", "0.12 (transforms + 4)"): (False, True),
    ("2.8", "0.13 (5 + serialization_format=)"): (False, False),
    ("2.8", "job shim (6 positional)"): (False, False),
}


def safe_for(
    fake_write_item: Callable[..., Any], plan: write_item.Plan, fs_extras: Tuple[str, ...] = ()
) -> Callable[..., Any]:
    signature = write_item.read_signature(fake_write_item)
    transforms_type = fake_torch.FakeStorageWriterTransforms if "_StorageWriterTransforms" in fs_extras else None
    return write_item.make_safe_write_item(fake_write_item, plan, signature, transforms_type, TS)


def force_plan(generation: str) -> write_item.Plan:
    signature = write_item.read_signature(fake_torch.FAKE_GENERATIONS[generation])
    decision = write_item.decide(
        "force", versions.WriterVersion("0.12.1", (0, 12, 1), "metadata"), signature, generation, lambda _: True
    )
    assert decision.plan is not None
    return decision.plan


def call_quietly(function: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Call, and turn the fake's TypeError/AttributeError (wrong arguments) into a value."""
    try:
        return function(*args, **kwargs)
    except (TypeError, AttributeError) as exc:
        return exc


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("generation", ["2.7", "2.8"])
def test_every_megatron_call_shape_reaches_the_fake_torch_with_exactly_the_right_arguments(generation, shape):
    """force plan: each call gets only what it lacks for that torch, and nothing else."""
    fake_write_item = fake_torch.FAKE_GENERATIONS[generation]
    safe = safe_for(fake_write_item, force_plan(generation), fake_torch.FAKE_GENERATION_EXTRAS[generation])
    given = SHAPES[shape](Args())
    del fake_torch.FAKE_CALLS[:]
    call_quietly(safe, *given)
    (call,) = fake_torch.FAKE_CALLS
    add_transforms, add_format = FORCE_MATRIX[(generation, shape)]
    args, kwargs = given
    if add_transforms:
        assert isinstance(call.args[0], fake_torch.FakeStorageWriterTransforms)
        assert call.args[0] is not args[0]  # the safe caller's own no-extension object
        assert call.args[0].extensions == []
        assert call.args[1:] == args
    else:
        assert call.args == args
    assert call.kwargs == (dict(kwargs, serialization_format=TS) if add_format else kwargs)


@pytest.mark.parametrize(
    "generation, version, shape",
    [
        ("2.7", "0.9.0", "0.9-0.11 (4 positional)"),
        ("2.8", "0.9.0", "0.9-0.11 (4 positional)"),
        ("2.8", "0.12.1", "0.12 (transforms + 4)"),
    ],
)
def test_affected_release_call_fails_raw_and_writes_tensor_bytes_through_the_safe_caller(generation, version, shape):
    """The auto plan for each affected pairing: raw call fails (the bug), safe call saves."""
    fake_write_item = fake_torch.FAKE_GENERATIONS[generation]
    signature = write_item.read_signature(fake_write_item)
    decision = write_item.decide(
        "auto",
        versions.WriterVersion(version, versions.parse_release(version), "metadata"),
        signature,
        generation,
        bool,
    )
    assert decision.plan is not None
    safe = write_item.make_safe_write_item(
        fake_write_item, decision.plan, signature, fake_torch.FakeStorageWriterTransforms, TS
    )

    raw_args, raw_kwargs = SHAPES[shape](Args())
    with pytest.raises(TypeError, match="missing"):
        fake_write_item(*raw_args, **raw_kwargs)

    args = Args()
    call_args, call_kwargs = SHAPES[shape](args)
    result = safe(*call_args, **call_kwargs)
    assert result.tensor_bytes_written is True
    assert args.stream.getvalue().startswith(fake_torch.FAKE_TENSOR_BYTES)
    last = fake_torch.FAKE_CALLS[-1]
    assert last.args[1:] == args.legacy
    assert isinstance(last.args[0], fake_torch.FakeStorageWriterTransforms)
    if shape.startswith("0.12"):
        assert last.args[0] is args.transforms  # the writer's own transforms, not replaced
    assert last.kwargs == ({"serialization_format": TS} if generation == "2.8" else {})


def test_torch_2_6_with_an_empty_plan_passes_the_legacy_call_through():
    """torch 2.6 needs nothing; a safe caller with nothing to add changes no call."""
    assert force_plan_or_none("2.6") is None
    safe = safe_for(fake_torch.fake_torch_2_6_write_item, write_item.Plan(False, False))
    args = Args()
    result = safe(*args.legacy)
    assert result.tensor_bytes_written is True
    assert fake_torch.FAKE_CALLS[-1] == fake_torch.FakeCall("fake_torch_2_6_write_item", args.legacy, {})


def force_plan_or_none(generation: str) -> Optional[write_item.Plan]:
    signature = write_item.read_signature(fake_torch.FAKE_GENERATIONS[generation])
    return write_item.decide("force", versions.WriterVersion(None, None, "?"), signature, generation, bool).plan


def test_safe_caller_reuses_one_no_extension_transforms_object():
    safe = safe_for(fake_torch.fake_torch_2_8_write_item, write_item.Plan(True, True), ("_StorageWriterTransforms",))
    safe(*Args().legacy)
    safe(*Args().legacy)
    first, second = fake_torch.FAKE_CALLS[-2:]
    assert first.args[0] is second.args[0]
    assert type(first.args[0]) is fake_torch.FakeStorageWriterTransforms


def test_caller_given_format_is_never_overridden():
    """A call that chose a format itself (even SAFETENSORS) keeps its choice."""
    safe = safe_for(fake_torch.fake_torch_2_8_write_item, write_item.Plan(True, True), ("_StorageWriterTransforms",))
    args = Args()
    safe(args.transforms, *args.legacy, serialization_format=SAFETENSORS)
    assert fake_torch.FAKE_CALLS[-1].kwargs == {"serialization_format": SAFETENSORS}


def test_safe_caller_is_marked_and_wraps_torch_once():
    safe = safe_for(fake_torch.fake_torch_2_8_write_item, write_item.Plan(False, True))
    assert write_item.is_safe_write_item(safe)
    assert getattr(safe, write_item.MARK) == mcore_autopatch.__version__
    assert safe.__wrapped__ is fake_torch.fake_torch_2_8_write_item
    assert not write_item.is_safe_write_item(safe.__wrapped__)


# --- torch 2.7: never a 6th positional argument -------------------------------------------

ALL_PLANS = [write_item.Plan(t, f) for t, f in itertools.product([False, True], repeat=2)]


def odd_calls() -> Iterator[Tuple[str, Tuple[Any, ...], Dict[str, Any]]]:
    """Every count of 0-5 positionals, first one a transforms object or not, with odd keywords."""
    a = Args()
    pool_plain = [a.stream, a.data, a.write_item, a.storage_key, "fake-extra"]
    pool_transforms = [a.transforms, *pool_plain[:4]]
    keyword_sets: List[Dict[str, Any]] = [
        {},
        {"serialization_format": TS},
        {"storage_key": "k"},
        {"safe_tensors": False},
    ]
    for n in range(6):
        for first_is_transforms in (False, True):
            if first_is_transforms and n == 0:
                continue
            args = tuple((pool_transforms if first_is_transforms else pool_plain)[:n])
            for kwargs in keyword_sets:
                yield (
                    "%d positional, transforms first=%s, kwargs=%s" % (n, first_is_transforms, sorted(kwargs)),
                    args,
                    kwargs,
                )
    yield "5 positional, a None first", (None, *a.legacy), {}
    yield "5 positional, a stream first", (a.stream, *a.legacy), {}
    yield "4 positional, transforms first", (a.transforms, a.stream, a.data, a.write_item), {}


@pytest.mark.parametrize("plan", ALL_PLANS, ids=lambda p: "transforms=%s,format=%s" % (p.add_transforms, p.add_format))
def test_torch_2_7_never_gets_a_sixth_positional_from_the_safe_caller(plan):
    """On torch 2.7 the 6th positional is safe_tensors: a truthy one silently drops tensor bytes.

    Over every plan (even ones the policy never makes for 2.7) and every call shape with
    at most five positionals, including odd ones, the fake receives at most five
    positionals and never ``safe_tensors``; transforms are added only in front of the
    legacy four-argument call.
    """
    safe = safe_for(fake_torch.fake_torch_2_7_write_item, plan, ("_StorageWriterTransforms",))
    checked = 0
    for label, args, kwargs in odd_calls():
        del fake_torch.FAKE_CALLS[:]
        call_quietly(safe, args, dict(kwargs))
        (call,) = fake_torch.FAKE_CALLS
        assert len(call.args) <= 5, label
        prepended = (
            plan.add_transforms and len(args) == 4 and not isinstance(args[0], fake_torch.FakeStorageWriterTransforms)
        )
        assert call.args[int(prepended) :] == args, label
        assert call.kwargs.get("safe_tensors", False) is False, label
        assert set(call.kwargs) - set(kwargs) <= ({"serialization_format"} if plan.add_format else set()), label
        checked += 1
    assert checked == 47  # 11 positional shapes x 4 keyword sets + 3 odd ones


def test_torch_2_7_without_the_fix_a_truthy_sixth_positional_loses_the_tensor_bytes():
    """Why the rule above matters: the fake, like torch 2.7, writes nothing for the tensor."""
    a = Args()
    result = fake_torch.fake_torch_2_7_write_item(a.transforms, *a.legacy, TS)
    assert result.tensor_bytes_written is False
    assert a.stream.getvalue() == b""


# --- plausible future signatures ----------------------------------------------------------


def test_future_safetensors_default_gets_torch_save_and_writes_the_bytes():
    """Were SAFETENSORS the default, a 0.12 call would write no tensor bytes; the fix passes TORCH_SAVE."""
    fake_write_item = fake_torch.fake_torch_future_default_safetensors
    a = Args()
    assert fake_write_item(a.transforms, *a.legacy).tensor_bytes_written is False  # without the fix
    signature = write_item.read_signature(fake_write_item)
    decision = write_item.decide(
        "auto", versions.WriterVersion("0.12.1", (0, 12, 1), "metadata"), signature, "2.99", bool
    )
    assert decision.plan == write_item.Plan(False, True)
    safe = write_item.make_safe_write_item(fake_write_item, decision.plan, signature, None, TS)
    a = Args()
    assert safe(a.transforms, *a.legacy).tensor_bytes_written is True
    assert fake_torch.FAKE_CALLS[-1].kwargs == {"serialization_format": TS}
    assert len(fake_torch.FAKE_CALLS[-1].args) == 5


def test_future_keyword_only_format_is_supplied_by_keyword():
    fake_write_item = fake_torch.fake_torch_future_keyword_only
    a = Args()
    with pytest.raises(TypeError, match="serialization_format"):
        fake_write_item(a.transforms, *a.legacy)  # without the fix
    safe = safe_for(fake_write_item, write_item.Plan(False, True))
    assert safe(a.transforms, *a.legacy).tensor_bytes_written is True
    assert fake_torch.FAKE_CALLS[-1].kwargs == {"serialization_format": TS}


def test_future_torch_save_default_gets_only_transforms_for_0_9():
    fake_write_item = fake_torch.fake_torch_future_default_torch_save
    safe = safe_for(fake_write_item, write_item.Plan(True, False), ("_StorageWriterTransforms",))
    a = Args()
    assert safe(*a.legacy).tensor_bytes_written is True
    call = fake_torch.FAKE_CALLS[-1]
    assert call.kwargs == {}
    assert call.args[1:] == a.legacy


# --- write_item.apply / evaluate on a fake writer module ----------------------------------


def test_apply_on_0_12_with_torch_2_8_rebinds_and_the_call_gets_the_format(fake, fake_megatron):
    fake.install("2.8")
    fake_megatron("0.12.1")
    writer = fake.writer()
    a = Args()
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'serialization_format'"):
        writer._write_item(a.transforms, *a.legacy)  # without the fix: the bug
    decision, applied = write_item.apply(writer, "auto")
    assert (decision.needed, applied) == (True, True)
    assert decision.reason == (
        "megatron-core 0.12.1 calls _write_item without serialization_format; torch 2.8.0+fake requires it"
    )
    result = writer._write_item(a.transforms, *a.legacy)
    assert result.tensor_bytes_written is True
    assert fake.calls[-1].args == (a.transforms, *a.legacy)
    assert fake.calls[-1].kwargs == {"serialization_format": TS}


def test_apply_twice_never_stacks_a_second_wrapper(fake, fake_megatron):
    fake.install("2.8")
    fake_megatron("0.9.0")
    writer = fake.writer()
    assert write_item.apply(writer, "auto")[1] is True
    first = writer._write_item
    assert write_item.apply(writer, "auto")[1] is True
    assert write_item.apply(writer, "force")[1] is True
    assert writer._write_item is first
    assert first.__wrapped__ is fake.fs._write_item
    assert not hasattr(first.__wrapped__, "__wrapped__")  # exactly one level


def test_apply_over_a_foreign_replacement_leaves_it_alone_with_reason(fake, fake_megatron):
    """A job's own shim is respected: never wrapped, never replaced; the reason names it."""
    fake.install("2.8")
    fake_megatron("0.12.1")
    writer = fake.writer()

    def fake_job_shim(*args, **kwargs):
        return fake.fs._write_item(*args, serialization_format=TS, **kwargs)

    writer._write_item = fake_job_shim
    decision, applied = write_item.apply(writer, "auto")
    assert applied is False
    assert writer._write_item is fake_job_shim
    assert decision.needed is True
    assert decision.reason.endswith(
        "; but %s._write_item is already %s.%s (a job's own fix?), so it is left alone"
        % (mcore_autopatch.WRITER_MODULE, __name__, fake_job_shim.__qualname__)
    )


def test_apply_over_another_copys_safe_caller_keeps_it(fake, fake_megatron):
    """A safe caller made by another copy of mcore-autopatch is recognised by its mark."""
    fake.install("2.8")
    fake_megatron("0.12.1")
    writer = fake.writer()

    def fake_other_copy_safe_caller(*args, **kwargs):
        return fake.fs._write_item(*args, **kwargs)

    setattr(fake_other_copy_safe_caller, write_item.MARK, "0.0.1")
    writer._write_item = fake_other_copy_safe_caller
    assert write_item.apply(writer, "auto")[1] is True
    assert writer._write_item is fake_other_copy_safe_caller


def test_apply_to_writer_without_write_item_global_not_applied_with_reason(fake, fake_megatron):
    fake.install("2.8")
    fake_megatron("0.12.1")
    writer = types.ModuleType(mcore_autopatch.WRITER_MODULE, "FAKE upstream rewrite without _write_item")
    decision, applied = write_item.apply(writer, "auto")
    assert (decision.needed, applied) == (None, False)
    assert decision.reason == (
        "%s has no _write_item global (an upstream rewrite?); not patching" % mcore_autopatch.WRITER_MODULE
    )
    assert "_write_item" not in vars(writer)


@pytest.mark.parametrize("missing", ["_write_item", "import"])
def test_apply_without_torch_write_item_not_applied_with_reason(fake, fake_megatron, missing):
    """torch's filesystem module without _write_item, or torch not importable at all."""
    fake_megatron("0.12.1")
    if missing == "import":
        fake.block_import()
        writer = types.ModuleType(mcore_autopatch.WRITER_MODULE)
        writer._write_item = None
    else:
        fake.install("2.8", without=("_write_item",))
        writer = fake.writer()
    decision, applied = write_item.apply(writer, "auto")
    assert (decision.needed, applied) == (None, False)
    assert decision.reason == "torch.distributed.checkpoint.filesystem has no _write_item; not patching"


@pytest.mark.parametrize("missing", ["SerializationFormat", "_StorageWriterTransforms"])
def test_apply_without_what_torch_must_be_given_not_applied(fake, fake_megatron, missing):
    fake.install("2.8", without=(missing,))
    fake_megatron("0.9.0")
    writer = fake.writer()
    original = writer._write_item
    decision, applied = write_item.apply(writer, "auto")
    assert (decision.needed, applied) == (True, False)
    assert decision.reason.endswith("but torch has no %s to supply; not patching" % missing)
    assert writer._write_item is original


@pytest.mark.parametrize("generation, version", [("2.6", "0.9.0"), ("2.7", "0.12.1"), ("2.8", "0.13.1")])
def test_apply_where_nothing_is_needed_changes_nothing(fake, fake_megatron, generation, version):
    fake.install(generation)
    fake_megatron(version)
    writer = fake.writer()
    original = writer._write_item
    decision, applied = write_item.apply(writer, "auto")
    assert (decision.needed, applied) == (False, False)
    assert writer._write_item is original


def test_apply_with_unknown_megatron_version_waits_for_force(fake):
    """No megatron-core version to read: auto patches nothing, force does."""
    fake.install("2.8")
    writer = fake.writer()
    decision, applied = write_item.apply(writer, "auto")
    assert (decision.needed, applied) == (None, False)
    assert decision.reason.endswith("; set MCORE_AUTOPATCH=force to patch anyway")
    decision, applied = write_item.apply(writer, "force")
    assert (decision.needed, applied) == (True, True)


@pytest.mark.parametrize("generation", ["2.7", "2.8"])
def test_apply_force_on_2_7_and_2_8_serves_0_12_and_0_9_calls(fake, generation):
    fake.install(generation)
    writer = fake.writer()
    assert write_item.apply(writer, "force")[1] is True
    a, b = Args(), Args()
    assert writer._write_item(*a.legacy).tensor_bytes_written is True
    assert writer._write_item(b.transforms, *b.legacy).tensor_bytes_written is True


def test_evaluate_decides_without_changing_the_writer(fake, fake_megatron):
    fake.install("2.8")
    fake_megatron("0.12.1")
    writer = fake.writer()
    original = writer._write_item
    ev = write_item.evaluate(writer, "auto")
    assert ev.decision.plan == write_item.Plan(False, True)
    assert ev.original is original
    assert writer._write_item is original


# --- the import-hook callback (mcore_autopatch.fixes) over re-imports ------------------------

WRITE_ITEM = fixes.FIXES[0]  # megatron-core's writer fix


def test_on_module_executed_for_each_reimport_wraps_each_module_once(fake, fake_megatron, caplog):
    """A reload or re-import executes a fresh body (torch's original again): one wrapper each time."""
    fake.install("2.8")
    fake_megatron("0.12.1")
    caplog.set_level(logging.DEBUG, logger="mcore_autopatch")
    writers = [fake.writer(), fake.writer()]
    for writer in writers:
        fixes.on_module_executed(writer)
        fixes.on_module_executed(writer)  # the package callback may look again
        assert write_item.is_safe_write_item(writer._write_item)
        assert writer._write_item.__wrapped__ is fake.fs._write_item
    assert fixes.last_decision(WRITE_ITEM) == {
        "needed": True,
        "applied": True,
        "reason": "megatron-core 0.12.1 calls _write_item without serialization_format; torch 2.8.0+fake requires it",
    }
    assert [r.levelname for r in caplog.records].count("WARNING") == 0
    assert [r.levelname for r in caplog.records].count("INFO") == 1  # the first decision only


def test_on_module_executed_warns_once_per_reason_when_needed_but_not_applied(fake, fake_megatron, caplog):
    fake.install("2.8", without=("SerializationFormat",))
    fake_megatron("0.12.1")
    caplog.set_level(logging.DEBUG, logger="mcore_autopatch")
    for _ in range(3):
        fixes.on_module_executed(fake.writer())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "fix needed but not applied" in warnings[0].getMessage()
    assert "no SerializationFormat" in warnings[0].getMessage()


def test_on_module_executed_with_mode_off_changes_nothing(fake, fake_megatron, monkeypatch):
    fake.install("2.8")
    fake_megatron("0.12.1")
    monkeypatch.setenv("MCORE_AUTOPATCH", "off")
    writer = fake.writer()
    fixes.on_module_executed(writer)
    assert writer._write_item is fake.fs._write_item
    assert fixes.last_decision(WRITE_ITEM) is None


def test_on_module_executed_never_raises_when_evaluation_breaks(fake, monkeypatch, caplog):
    """A failure inside the decision is logged; the import that triggered it goes on."""
    fake.install("2.8")

    def fake_broken_version(writer: object) -> None:
        raise RuntimeError("fake: metadata reader exploded")

    monkeypatch.setattr(versions, "writer_version", fake_broken_version)
    writer = fake.writer()
    fixes.on_module_executed(writer)
    assert writer._write_item is fake.fs._write_item
    assert any("left unchanged" in r.getMessage() for r in caplog.records)
