"""Unit tests of the mcore_data fixes (keep_mcore_data, load_without_mcore_data, shared/checkpoint_metadata), on fakes.

The real releases are tested end to end in tests/test_e2e_job_path.py. Here, FAKE torch and
megatron modules (named so) stand in for shapes of code no release has, and for the cases
each robustness rule covers; the fakes' code has the shape of the real one (a ``finish`` that
calls ``dataclasses.replace``, a planner that stores ``metadata.mcore_data``).
"""

import dataclasses
import logging
import sys
import types
from typing import Any, Dict, List, Optional

import pytest

from mcore_autopatch import fixes
from mcore_autopatch.fixes import keep_mcore_data, load_without_mcore_data
from mcore_autopatch.shared import checkpoint_metadata as cm
from mcore_autopatch.shared import standin

# --- FAKE torch: a Metadata dataclass and two generations of FileSystemWriter.finish ---------


@dataclasses.dataclass
class FakeMetadata:  # FAKE torch.distributed.checkpoint.metadata.Metadata
    state_dict_metadata: Dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    version: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class FakeSavePlan:  # FAKE torch SavePlan: replace() of it must never change
    items: List[Any]
    storage_data: Any = None


# FAKE writers, defined inside their FAKE filesystem module (their globals are its globals,
# as torch's finish's are torch's filesystem module's), in the shape of torch's code.
FAKE_WRITERS = {
    # torch 2.9-2.11: finish starts with dataclasses.replace
    "replacing": """
class FileSystemWriter:
    def finish(self, metadata, results):
        metadata = dataclasses.replace(metadata, version="1.0.0")
        metadata.storage_data = results
        return metadata
""",
    # torch <= 2.8 and >= 2.12: finish sets the version in place
    "in place": """
class FileSystemWriter:
    def finish(self, metadata, results):
        metadata.version = "1.0.0"
        metadata.storage_data = results
        return metadata
""",
    # a future torch that builds a new Metadata some other way
    "rebuilding": """
class FileSystemWriter:
    def finish(self, metadata, results):
        return Metadata(metadata.state_dict_metadata)
""",
    "without finish": """
class FileSystemWriter:
    pass
""",
}


def fake_fs(kind: str) -> types.ModuleType:
    """A FAKE torch.distributed.checkpoint.filesystem of one kind."""
    module = types.ModuleType(keep_mcore_data.TORCH_FS_MODULE, "FAKE torch filesystem module (%s)" % kind)
    vars(module).update(dataclasses=dataclasses, Metadata=FakeMetadata)
    exec(compile(FAKE_WRITERS[kind], "<FAKE torch filesystem: %s>" % kind, "exec"), vars(module))
    return module


def test_read_finish_tells_the_three_kinds_of_finish_apart():
    replacing = fake_fs("replacing")
    assert keep_mcore_data.read_finish(replacing).drops is True
    assert keep_mcore_data.read_finish(replacing).target == "dataclasses"
    assert keep_mcore_data.read_finish(replacing).namespace is vars(replacing)
    assert keep_mcore_data.read_finish(fake_fs("in place")).drops is False
    unknown = keep_mcore_data.read_finish(fake_fs("rebuilding"))
    assert unknown.drops is None and "does not know" in unknown.text


def test_read_finish_of_a_writer_without_finish_cannot_tell():
    assert keep_mcore_data.read_finish(fake_fs("without finish")).drops is None


def test_keeping_replace_carries_only_the_named_attributes_of_a_metadata():
    replace = keep_mcore_data.keeping_replace(dataclasses.replace, FakeMetadata, ("mcore_data", "all_local_plans"))
    old = FakeMetadata({"w": 1})
    old.mcore_data = {"w": {}}  # type: ignore[attr-defined]
    old.all_local_plans = ["plan"]  # type: ignore[attr-defined]
    old.something_else = "not ours to keep"  # type: ignore[attr-defined]
    new = replace(old, version="1.0.0")
    assert new.version == "1.0.0" and new.state_dict_metadata is old.state_dict_metadata
    assert new.mcore_data == {"w": {}} and new.all_local_plans == ["plan"]
    assert not hasattr(new, "something_else")
    assert type(new) is FakeMetadata  # torch's own class: nothing of ours in the pickle


def test_keeping_replace_leaves_other_dataclasses_exactly_as_the_real_replace():
    replace = keep_mcore_data.keeping_replace(dataclasses.replace, FakeMetadata, ("mcore_data",))
    plan = FakeSavePlan(items=[1])
    assert replace(plan, storage_data="x") == dataclasses.replace(plan, storage_data="x")


def test_stand_in_for_dataclasses_is_the_real_module_but_for_replace():
    replace = keep_mcore_data.keeping_replace(dataclasses.replace, FakeMetadata, ("mcore_data",))
    namespace = {"dataclasses": dataclasses}
    assert standin.rebind(namespace, "dataclasses", dataclasses, {"replace": replace}, "keeps mcore_data") is None
    stand_in = namespace["dataclasses"]
    assert stand_in.fields is dataclasses.fields and stand_in.dataclass is dataclasses.dataclass
    assert stand_in.replace is replace and stand_in.replace is not dataclasses.replace
    assert "mcore_data" in repr(stand_in) and "dataclasses" in repr(stand_in)
    assert keep_mcore_data._is_dataclasses(stand_in)


class FakePlanner:  # FAKE megatron-core 0.8-0.14 MCoreSavePlanner
    def create_global_plan(self, all_plans: Any) -> Any:
        plan, metadata = all_plans, FakeMetadata({})
        metadata.mcore_data = dict(p for p in ())  # type: ignore[attr-defined]
        return plan, metadata


class FakePlannerDeclaring:  # FAKE megatron-core 0.15: a Metadata subclass declares the field
    def create_global_plan(self, all_plans: Any) -> Any:
        mcore_data: Dict[str, Any] = {}
        return all_plans, FakeMetadata(state_dict_metadata={"mcore_data": mcore_data})


def fake_strategies(planner: type) -> types.ModuleType:
    module = types.ModuleType(fixes.STRATEGIES_TORCH, "FAKE megatron-core strategies.torch")
    module.MCoreSavePlanner = planner  # type: ignore[attr-defined]
    return module


def test_megatron_attributes_are_read_from_the_planners_attribute_stores(monkeypatch):
    monkeypatch.delitem(sys.modules, keep_mcore_data.SAVER_MODULE, raising=False)
    assert keep_mcore_data.megatron_attributes(fake_strategies(FakePlanner), FakeMetadata) == ("mcore_data",)
    assert keep_mcore_data.megatron_attributes(fake_strategies(FakePlannerDeclaring), FakeMetadata) == ()


def test_an_attribute_torch_declares_is_not_carried(monkeypatch):
    @dataclasses.dataclass
    class FakeMetadataDeclaringIt(FakeMetadata):  # FAKE: a torch whose Metadata has the field
        mcore_data: Any = None

    monkeypatch.delitem(sys.modules, keep_mcore_data.SAVER_MODULE, raising=False)
    assert keep_mcore_data.megatron_attributes(fake_strategies(FakePlanner), FakeMetadataDeclaringIt) == ()


@pytest.fixture
def fake_torch_modules(monkeypatch):
    """FAKE torch filesystem and metadata modules in sys.modules for one test."""

    def install(kind: str) -> types.ModuleType:
        fs = fake_fs(kind)
        metadata_module = types.ModuleType(keep_mcore_data.TORCH_METADATA_MODULE, "FAKE torch metadata module")
        metadata_module.Metadata = FakeMetadata  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, keep_mcore_data.TORCH_FS_MODULE, fs)
        monkeypatch.setitem(sys.modules, keep_mcore_data.TORCH_METADATA_MODULE, metadata_module)
        monkeypatch.delitem(sys.modules, keep_mcore_data.SAVER_MODULE, raising=False)
        return fs

    return install


def test_apply_rebinds_once_and_the_finish_keeps_mcore_data(fake_torch_modules):
    fs = fake_torch_modules("replacing")
    strategies = fake_strategies(FakePlanner)
    decision, applied = keep_mcore_data.apply(strategies, "auto")
    assert decision.needed is True and applied is True
    stand_in = fs.dataclasses
    assert keep_mcore_data.apply(strategies, "auto") == (decision, True)
    assert fs.dataclasses is stand_in  # never wrapped twice
    metadata = FakeMetadata({"w": 1})
    metadata.mcore_data = {"w": {"nd_reformulated_orig_global_shape": (8, 6)}}  # type: ignore[attr-defined]
    finished = fs.FileSystemWriter().finish(metadata, {"r": 1})
    assert finished.mcore_data == metadata.mcore_data


def test_apply_leaves_a_torch_that_keeps_the_attributes_alone(fake_torch_modules):
    fs = fake_torch_modules("in place")
    decision, applied = keep_mcore_data.apply(fake_strategies(FakePlanner), "auto")
    assert decision.needed is False and applied is False
    assert fs.dataclasses is dataclasses


def test_apply_leaves_a_megatron_without_undeclared_attributes_alone(fake_torch_modules):
    fs = fake_torch_modules("replacing")
    decision, applied = keep_mcore_data.apply(fake_strategies(FakePlannerDeclaring), "auto")
    assert (decision.needed, applied) == (False, False)
    assert fs.dataclasses is dataclasses


def test_apply_does_not_patch_an_unknown_finish(fake_torch_modules):
    fs = fake_torch_modules("rebuilding")
    decision, applied = keep_mcore_data.apply(fake_strategies(FakePlanner), "auto")
    assert decision.needed is None and applied is False and "not patching" in decision.reason
    assert fs.dataclasses is dataclasses


def test_apply_leaves_a_dataclasses_global_someone_else_replaced(fake_torch_modules):
    fs = fake_torch_modules("replacing")
    foreign = types.SimpleNamespace(replace=dataclasses.replace)
    fs.dataclasses = foreign
    decision, applied = keep_mcore_data.apply(fake_strategies(FakePlanner), "auto")
    assert (decision.needed, applied) == (None, False)
    assert "calls a replace() mcore-autopatch does not know" in decision.reason
    assert fs.dataclasses is foreign


def test_a_failing_reading_is_contained_and_logged(fake_torch_modules, monkeypatch, caplog):
    fake_torch_modules("replacing")
    monkeypatch.setattr(fixes, "_state", fixes._fresh_state())

    def fake_exploding_read(fs: Any) -> Any:
        raise RuntimeError("FAKE: reading finish exploded")

    monkeypatch.setattr(keep_mcore_data, "read_finish", fake_exploding_read)
    module = fake_strategies(FakePlanner)
    caplog.set_level(logging.WARNING, logger="mcore_autopatch")
    fixes.on_module_executed(module)  # never raises into the import
    assert any("keep_mcore_data: checking" in r.getMessage() for r in caplog.records)


# --- checkpoint_metadata: classification and proofs, on FAKE unpickled metadata ---------------


@dataclasses.dataclass
class FakeChunk:
    offsets: tuple
    sizes: tuple


@dataclasses.dataclass
class FakeTensorEntry:  # FAKE TensorStorageMetadata
    size: tuple
    chunks: List[FakeChunk]


def entry(size: tuple, chunk: tuple) -> FakeTensorEntry:
    """A regularly sharded entry: every chunk of shape ``chunk``."""
    import itertools

    grid = [range(0, s, c) for s, c in zip(size, chunk)]
    return FakeTensorEntry(size, [FakeChunk(tuple(o), chunk) for o in itertools.product(*grid)])


def flattened_entry(saved: tuple, pieces: List[int]) -> FakeTensorEntry:
    """A reformulated entry: chunks 1 x ... x 1 x n, the last axis split into ``pieces``."""
    import itertools

    chunks = []
    for lead in itertools.product(*[range(s) for s in saved[:-1]]):
        start = 0
        for n in pieces:
            chunks.append(FakeChunk((*lead, start), (*((1,) * len(lead)), n)))
            start += n
    return FakeTensorEntry(saved, chunks)


def fake_checkpoint(**entries: Any) -> FakeMetadata:
    return FakeMetadata({k.replace("__", "."): v for k, v in entries.items()})


KEY = "optimizer.state.exp_avg.decoder.weight"


def test_a_model_tensor_saved_beside_proves_the_original_shape():
    metadata = fake_checkpoint(decoder__weight=entry((8, 6), (4, 6)), **{"x": entry((1,), (1,))})
    metadata.state_dict_metadata[KEY] = flattened_entry((2, 1, 24), [10, 14])
    info = {t.key: t for t in cm.classify(metadata)}[KEY]
    assert (info.kind, info.shape) == ("flattened", (8, 6))
    assert cm.recovered_mcore_data(cm.classify(metadata))[KEY] == {cm.ORIGINAL_SHAPE: (8, 6)}


def test_a_model_tensor_whose_reformulation_differs_proves_nothing():
    metadata = fake_checkpoint(decoder__weight=entry((8, 6), (8, 6)))  # saved unsharded: (1, 1, 48)
    metadata.state_dict_metadata[KEY] = flattened_entry((2, 1, 24), [24])
    info = {t.key: t for t in cm.classify(metadata)}[KEY]
    assert info.kind == "unknown" and info.shape is None
    assert cm.recovered_mcore_data(cm.classify(metadata)) is None


def test_a_layer_stacked_weight_is_regular_however_its_chunks_look():
    metadata = fake_checkpoint(decoder__layers__norm__weight=entry((4, 6), (1, 6)))
    (info,) = cm.classify(metadata)
    assert info.kind == "regular"  # megatron-core flattens only optimizer state


def test_with_mcore_data_the_checkpoint_says_everything_itself():
    metadata = fake_checkpoint(decoder__weight=entry((8, 6), (4, 6)))
    metadata.state_dict_metadata[KEY] = flattened_entry((2, 1, 24), [24])
    metadata.mcore_data = {KEY: {cm.ORIGINAL_SHAPE: (8, 6)}, "decoder.weight": {}}  # type: ignore[attr-defined]
    kinds = {t.key: (t.kind, t.evidence) for t in cm.classify(metadata)}
    assert kinds == {KEY: ("flattened", "mcore_data"), "decoder.weight": ("regular", "mcore_data")}


def test_read_metadata_of_bad_input_says_why(tmp_path):
    with pytest.raises(cm.CheckpointProblem, match="is not a folder"):
        cm.read_metadata(str(tmp_path / "nowhere"))
    with pytest.raises(cm.CheckpointProblem, match=r"no \.metadata file"):
        cm.read_metadata(str(tmp_path))
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(cm.CheckpointProblem, match="cannot read"):
        cm.read_metadata(str(tmp_path))


# --- load_without_mcore_data, on a FAKE megatron-core strategies.torch ---------------------------------------


class FakeCheckpointingException(Exception):  # FAKE megatron.core.dist_checkpointing.core's
    pass


@dataclasses.dataclass
class FakeShardedTensor:  # FAKE megatron-core ShardedTensor: what the guard reads of it
    key: str
    global_shape: tuple
    reformulated: tuple  # what nd_flattened_tensor_reformulated_global_shape gives
    flattened_range: Any = "a flattened range"


def fake_loader_module(metadata: Any) -> types.ModuleType:
    module = types.ModuleType(fixes.STRATEGIES_TORCH, "FAKE megatron-core strategies.torch (loader)")

    class FakeReader:
        def __init__(self, folder: Any) -> None:
            self.folder = folder

        def read_metadata(self) -> Any:
            return metadata

    def get_reformulation_metadata(sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        ckpt = FakeReader(checkpoint_dir).read_metadata()
        return {t.key: ckpt.mcore_data[t.key] for t in sharded_state_dict.values()}

    class TorchDistLoadShardedStrategy:
        def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> Any:
            shapes = getattr(metadata, "mcore_data", {})
            return {k: shapes.get(k, {}).get(cm.ORIGINAL_SHAPE, e.size) for k, e in cm.tensor_entries(metadata).items()}

    vars(module).update(
        get_reformulation_metadata=get_reformulation_metadata,
        FileSystemReader=FakeReader,
        nested_values=lambda d: list(d.values()),
        is_nd_flattened_tensor=lambda t: t.flattened_range is not None,
        nd_flattened_tensor_reformulated_global_shape=lambda t: t.reformulated,
        TensorReformulationMetadata=lambda shape, saved: ("reformulation", tuple(shape), tuple(saved)),
        CheckpointingException=FakeCheckpointingException,
        TorchDistLoadShardedStrategy=TorchDistLoadShardedStrategy,
    )
    return module


def lost_metadata(with_model: bool) -> FakeMetadata:
    metadata = fake_checkpoint(decoder__weight=entry((8, 6), (4, 6))) if with_model else fake_checkpoint()
    metadata.state_dict_metadata[KEY] = flattened_entry((2, 1, 24), [10, 14])
    return metadata


def test_guard_is_needed_where_megatron_reads_mcore_data_and_applied_once():
    module = fake_loader_module(lost_metadata(True))
    assert load_without_mcore_data.evaluate(module, "auto").decision.needed is True
    assert load_without_mcore_data.apply(module, "auto")[1] is True
    guarded = module.get_reformulation_metadata
    load_without_mcore_data.apply(module, "auto")
    assert module.get_reformulation_metadata is guarded and load_without_mcore_data.is_applied(module)


def test_guard_same_layout_needs_no_shape():
    module = fake_loader_module(lost_metadata(False))
    load_without_mcore_data.apply(module, "auto")
    app = {KEY: FakeShardedTensor(KEY, (8, 6), (2, 1, 24))}
    assert module.get_reformulation_metadata(app, "ckpt") == {KEY: ("reformulation", (8, 6), (2, 1, 24))}


def test_guard_other_layout_uses_the_proved_shape():
    module = fake_loader_module(lost_metadata(True))
    load_without_mcore_data.apply(module, "auto")
    app = {KEY: FakeShardedTensor(KEY, (8, 6), (1, 1, 48))}
    assert module.get_reformulation_metadata(app, "ckpt") == {KEY: ("reformulation", (8, 6), (2, 1, 24))}


def test_guard_other_layout_without_proof_raises_the_cause_and_the_way_out():
    module = fake_loader_module(lost_metadata(False))
    load_without_mcore_data.apply(module, "auto")
    app = {KEY: FakeShardedTensor(KEY, (8, 6), (1, 1, 48))}
    with pytest.raises(FakeCheckpointingException) as raised:
        module.get_reformulation_metadata(app, "ckpt")
    message = str(raised.value)
    assert "has no mcore_data in its .metadata" in message
    assert "%s (saved as (2, 1, 24), this job's layout needs (1, 1, 48))" % KEY in message
    assert "resume with the tensor- and pipeline-parallel sizes" in message


def test_guard_passes_a_checkpoint_with_mcore_data_through_untouched():
    metadata = lost_metadata(False)
    metadata.mcore_data = {KEY: "megatron's own answer"}  # type: ignore[attr-defined]
    module = fake_loader_module(metadata)
    load_without_mcore_data.apply(module, "auto")
    app = {KEY: FakeShardedTensor(KEY, (8, 6), (1, 1, 48))}
    assert module.get_reformulation_metadata(app, "ckpt") == {KEY: "megatron's own answer"}


def test_guarded_load_tensors_metadata_describes_proved_shapes_or_refuses():
    module = fake_loader_module(lost_metadata(True))
    load_without_mcore_data.apply(module, "auto")
    strategy = module.TorchDistLoadShardedStrategy()
    assert strategy.load_tensors_metadata("ckpt")[KEY] == (8, 6)
    bare = fake_loader_module(lost_metadata(False))
    load_without_mcore_data.apply(bare, "auto")
    with pytest.raises(FakeCheckpointingException, match="cannot be proved"):
        bare.TorchDistLoadShardedStrategy().load_tensors_metadata("ckpt")


def test_guard_is_not_needed_where_megatron_does_not_read_mcore_data():
    module = fake_loader_module(lost_metadata(True))
    module.get_reformulation_metadata = lambda sharded_state_dict, checkpoint_dir: {}
    assert load_without_mcore_data.evaluate(module, "auto").decision.needed is False
    assert load_without_mcore_data.apply(module, "auto")[1] is False


@pytest.mark.parametrize("kind", ["replacing", "in place", "rebuilding", "without finish"])
def test_keep_mcore_data_gate_rules_out_only_a_finish_the_fix_would_call_in_place(fake_torch_modules, kind):
    """The table's gate reads torch's finish by names, without importing keep_mcore_data; where it
    rules the fix out, the fix itself says "not needed" too."""
    assert fixes.TORCH_FILESYSTEM == keep_mcore_data.TORCH_FS_MODULE
    fake_torch_modules(kind)
    gated = fixes._torch_finish_may_rebuild_the_metadata(fake_strategies(FakePlanner))
    decided = keep_mcore_data.evaluate(fake_strategies(FakePlanner), "auto").decision.needed
    if kind == "in place":
        assert gated is not None and "updates the Metadata in place" in gated and decided is False
    else:
        assert gated is None and decided is not False
