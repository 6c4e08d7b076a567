"""Units of tensor_properties_fields on FAKE torch modules shaped like torch 2.13 (five fields of
TensorProperties) and 2.15 (``strides``, which torch.empty refuses), and a FAKE megatron-core
module with its ``load_tensors_metadata`` call. Real torch 2.15.0 with every megatron-core
release is proven end to end in tests/test_e2e_fresh_stack.py."""

import dataclasses
import sys
import types
from typing import Any, Optional, Tuple

import pytest

from mcore_autopatch import fixes
from mcore_autopatch.fixes import tensor_properties_fields
from mcore_autopatch.shared import standin

TAKES = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


@dataclasses.dataclass
class FakeProperties213:  # FAKE: torch 2.13's TensorProperties fields
    dtype: Any = "float32"
    layout: Any = "strided"
    requires_grad: bool = False
    memory_format: Any = "contiguous_format"
    pin_memory: bool = False


@dataclasses.dataclass
class FakeProperties215(FakeProperties213):  # FAKE: torch 2.15 added strides
    strides: Optional[Tuple[int, ...]] = None


def fake_torch(version: str) -> types.ModuleType:
    torch = types.ModuleType("torch", "FAKE torch %s" % version)
    torch.__version__ = version  # type: ignore[attr-defined]

    def empty(size, *, device=None, **kwargs):
        unknown = set(kwargs) - set(TAKES)
        if unknown:
            raise TypeError("empty() got an unexpected keyword argument '%s'" % sorted(unknown)[0])
        return ("meta tensor", tuple(size), device, kwargs.get("dtype"))

    torch.empty = empty  # type: ignore[attr-defined]
    torch.zeros = empty  # type: ignore[attr-defined]
    return torch


FAKE_MEGATRON = """
import torch

class TorchDistLoadShardedStrategy:
    def load_tensors_metadata(self, metadata):
        return {k: torch.empty(tp.size, **tp.properties.__dict__, device='meta') for k, tp in metadata.items()}

def unrelated():
    return torch.zeros((1,), device="cpu")
"""


@pytest.fixture
def stack(monkeypatch):
    def make(properties: type, version: str) -> types.ModuleType:
        torch = fake_torch(version)
        metadata = types.ModuleType(tensor_properties_fields.TORCH_METADATA)
        metadata.TensorProperties = properties  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torch", torch)
        monkeypatch.setitem(sys.modules, tensor_properties_fields.TORCH_METADATA, metadata)
        module = types.ModuleType("megatron.core.dist_checkpointing.strategies.torch")
        exec(compile(FAKE_MEGATRON, "FAKE_strategies_torch.py", "exec"), vars(module))
        return module

    return make


def saved(properties: type) -> Any:
    return {"w": types.SimpleNamespace(size=(4, 6), properties=properties(dtype="bfloat16"))}


def test_on_a_torch_that_added_strides_the_meta_tensors_are_built_without_it(stack):
    module = stack(FakeProperties215, "2.15.0")
    strategy = module.TorchDistLoadShardedStrategy()
    with pytest.raises(TypeError, match="unexpected keyword argument 'strides'"):
        strategy.load_tensors_metadata(saved(FakeProperties215))
    assert fixes.ruled_out(fixes.by_name("tensor_properties_fields"), module) is None
    decision, applied = tensor_properties_fields.apply(module, "auto")
    assert (decision.needed, applied) == (True, True)
    assert "strides, which torch.empty refuses" in decision.reason
    assert "TorchDistLoadShardedStrategy.load_tensors_metadata" in decision.where
    described = strategy.load_tensors_metadata(saved(FakeProperties215))
    assert described["w"] == ("meta tensor", (4, 6), "meta", "bfloat16")
    assert standin.overrides(module.torch) == ("empty",)
    assert module.torch.zeros is sys.modules["torch"].zeros  # everything else is torch itself
    assert tensor_properties_fields.is_applied(module)
    _again, applied = tensor_properties_fields.apply(module, "auto")  # a second look stacks nothing
    assert applied and module.torch.empty.__wrapped__ is sys.modules["torch"].empty


def test_on_a_torch_whose_fields_empty_takes_the_table_rules_it_out_without_importing_it(stack):
    module = stack(FakeProperties213, "2.13.0")
    reason = fixes.ruled_out(fixes.by_name("tensor_properties_fields"), module)
    assert reason == "torch.empty takes every field of torch 2.13.0's TensorProperties"
    decision, applied = tensor_properties_fields.apply(module, "auto")
    assert (decision.needed, applied) == (False, False)
    assert module.torch is sys.modules["torch"]


def test_a_module_that_never_builds_tensors_from_properties_is_left_alone(stack):
    module = stack(FakeProperties215, "2.15.0")
    del module.TorchDistLoadShardedStrategy
    decision, applied = tensor_properties_fields.apply(module, "auto")
    assert (decision.needed, applied) == (False, False)
    assert "never passes a TensorProperties' fields to torch.empty" in decision.reason


def test_the_gate_knows_what_torch_empty_took_through_2_14():
    assert set(fixes.EMPTY_TAKES) == set(TAKES) == {f.name for f in dataclasses.fields(FakeProperties213)}
