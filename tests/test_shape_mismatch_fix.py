"""Units of allow_shape_mismatch_on_load on FAKE planners shaped like megatron-core 0.6 - 0.11's
(and 0.12's) MCoreLoadPlanner, over a FAKE torch planner that refuses other sizes as torch 2.6+
does. The real releases, on real torch, are in tests/test_e2e_shape_mismatch.py."""

import sys
import types

import pytest

from mcore_autopatch import fixes
from mcore_autopatch.fixes import allow_shape_mismatch_on_load as fix
from mcore_autopatch.shared import versions

FAKE_TORCH_PLANNER = """
def create_default_local_load_plan(state_dict, metadata, strict=True):
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata[fqn]
        if hasattr(md, "chunks") and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
    return "plan"
"""
FAKE_PLANNER_0_11 = """
from FAKE_default_planner import create_default_local_load_plan

class MCoreLoadPlanner:
    def __init__(self, shapes_validation_sharded_tensors=()):
        self.shapes_validation_sharded_tensors = shapes_validation_sharded_tensors

    def create_local_plan(self):
        for sh_ten in self.shapes_validation_sharded_tensors:
            if self.metadata.state_dict_metadata[sh_ten.key].size != sh_ten.global_shape:
                raise RuntimeError("Global shape mismatch for key %s" % sh_ten.key)
        return create_default_local_load_plan(self.state_dict, self.metadata)
"""
FAKE_PLANNER_0_12 = (
    FAKE_PLANNER_0_11
    + """
    def _temporarily_bypass_shape_validation(self):
        pass
"""
)


class FakeEntry:  # FAKE: torch's TensorStorageMetadata (size, chunks)
    def __init__(self, size):
        self.size, self.chunks = size, []


class FakeTensor:  # FAKE: what torch's planner asks the size of
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


class FakeShardedTensor:  # FAKE: megatron-core's ShardedTensor, key and global shape
    def __init__(self, key, global_shape):
        self.key, self.global_shape = key, global_shape


def module_from(name, source):
    module = types.ModuleType(name, "FAKE (tests/test_shape_mismatch_fix.py)")
    exec(compile(source, name + ".py", "exec"), vars(module))
    return module


@pytest.fixture
def strategies(monkeypatch):
    torch_planner = module_from("FAKE_default_planner", FAKE_TORCH_PLANNER)
    monkeypatch.setitem(sys.modules, "FAKE_default_planner", torch_planner)
    monkeypatch.setitem(sys.modules, fix.TORCH_PLANNER_MODULE, torch_planner)
    monkeypatch.setattr(versions, "writer_version", lambda writer: versions.WriterVersion("0.11.0", (0, 11, 0), "m"))
    return lambda source=FAKE_PLANNER_0_11: module_from("megatron.core.dist_checkpointing.strategies.torch", source)


def planner_for(module, saved, asked, rigid=()):
    planner = module.MCoreLoadPlanner(shapes_validation_sharded_tensors=[FakeShardedTensor(k, asked[k]) for k in rigid])
    planner.metadata = types.SimpleNamespace(state_dict_metadata={k: FakeEntry(v) for k, v in saved.items()})
    planner.state_dict = {k: FakeTensor(v) for k, v in asked.items()}
    return planner


def test_without_the_fix_a_padded_vocabulary_of_another_size_is_refused(strategies):
    planner = planner_for(strategies(), {"emb": (8, 6)}, {"emb": (12, 6)})
    with pytest.raises(ValueError, match=r"Size mismatch between saved \(8, 6\) and current: \(12, 6\) for emb"):
        planner.create_local_plan()


def test_with_the_fix_tensors_megatron_does_not_validate_plan_at_the_asked_size(strategies):
    module = strategies()
    decision, applied = fix.apply(module, "auto")
    assert decision.needed and applied, decision.reason
    planner = planner_for(module, {"emb": (8, 6), "w": (4,)}, {"emb": (12, 6), "w": (4,)}, rigid=["w"])
    assert planner.create_local_plan() == "plan"
    assert planner.metadata.state_dict_metadata["emb"].size == (8, 6)  # the saved size is given back


def test_with_the_fix_a_rigid_tensor_of_another_shape_still_fails(strategies):
    module = strategies()
    fix.apply(module, "auto")
    planner = planner_for(module, {"emb": (8, 6)}, {"emb": (12, 6)}, rigid=["emb"])
    with pytest.raises(RuntimeError, match="Global shape mismatch for key emb"):
        planner.create_local_plan()


def test_the_saved_size_is_given_back_when_planning_fails(strategies):
    module = strategies()
    fix.apply(module, "auto")
    planner = planner_for(module, {"emb": (8, 6)}, {"emb": (12, 6)})
    planner.state_dict["missing"] = FakeTensor((1,))
    with pytest.raises(KeyError):
        planner.create_local_plan()
    assert planner.metadata.state_dict_metadata["emb"].size == (8, 6)


def test_a_release_with_its_own_way_past_the_check_is_left_alone(strategies):
    """megatron-core 0.12+: MCoreLoadPlanner._temporarily_bypass_shape_validation."""
    module = strategies(FAKE_PLANNER_0_12)
    assert fix.evaluate(module, "auto").decision.needed is False
    assert fixes._planner_may_lack_a_shape_bypass(module) is not None  # ruled out before any import


def test_a_torch_that_does_not_compare_sizes_needs_nothing(strategies, monkeypatch):
    """torch 2.4 / 2.5: no size check in create_default_local_load_plan."""
    older = module_from(
        "FAKE_default_planner_2_5", "def create_default_local_load_plan(state_dict, metadata):\n  pass\n"
    )
    monkeypatch.setitem(sys.modules, fix.TORCH_PLANNER_MODULE, older)
    decision = fix.evaluate(strategies(), "auto").decision
    assert decision.needed is False and "does not compare saved and asked sizes" in decision.reason
