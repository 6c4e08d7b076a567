"""Tensors saved with ``allow_shape_mismatch`` load into another shape again on torch 2.6+.

megatron-core marks with ``allow_shape_mismatch=True`` the tensors whose shape follows the
parallel layout: the word embeddings and the output layer (Megatron-LM pads the vocabulary to
a multiple of ``make_vocab_size_divisible_by x TP``) and the distributed optimizer's
bucket-space buffers. Loading one into another shape reads the overlap and leaves zeros
elsewhere; that is how a resume changes TP. torch 2.6 added a size check to
``create_default_local_load_plan`` (``ValueError: Size mismatch between saved ... and
current: ... for <key>``), which megatron-core's ``MCoreLoadPlanner`` hands every tensor to.
0.12 gets its own way past it (it sets the checkpoint metadata's size to the requested one
around torch's planning); 0.6 - 0.11 do not, so such a resume fails.

What is read: whether torch's ``create_default_local_load_plan`` compares sizes (its code's
message), and whether megatron-core's ``MCoreLoadPlanner`` knows the tensors it must validate
itself (``shapes_validation_sharded_tensors``: every ShardedTensor saved without
``allow_shape_mismatch``) and has no way past torch's check of its own.

What is rebound: ``MCoreLoadPlanner.create_local_plan``, on that class only. megatron-core's
own method runs (its own shape validation of the rigid tensors first, as always); while it
runs, the checkpoint metadata of each tensor it does not validate (one saved with
``allow_shape_mismatch``) gives the size the load asks for, as 0.12 does, and gets its saved
size back afterwards. Rigid tensors of another shape still fail, with megatron-core's
``Global shape mismatch``; nothing changes in what a checkpoint holds.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable, List, Tuple

from mcore_autopatch.shared import code_reading, methods, versions
from mcore_autopatch.shared.values import Decision

PLANNER = "MCoreLoadPlanner"
TORCH_PLANNER_MODULE = "torch.distributed.checkpoint.default_planner"
TORCH_CHECK = "Size mismatch between saved"
RIGID = "shapes_validation_sharded_tensors"  # what megatron-core validates itself
# What 0.12+ have of their own to get past torch's check.
OWN_BYPASS = ("_temporarily_bypass_shape_validation", "allow_shape_mismatch_sharded_tensors")


class Evaluation:
    __slots__ = ("decision", "planner")

    def __init__(self, decision: Decision, planner: Any = None) -> None:
        self.decision = decision
        self.planner = planner


def torch_compares_sizes() -> "Tuple[bool | None, str]":
    """Whether torch's local load plan refuses a saved size that differs from the asked one."""
    label = "torch %s" % versions.torch_version()
    plan = getattr(sys.modules.get(TORCH_PLANNER_MODULE), "create_default_local_load_plan", None)
    code = getattr(plan, "__code__", None)
    if code is None:
        return None, "%s has no create_default_local_load_plan to read" % label
    constants = {c for nested in code_reading.nested(code) for c in nested.co_consts if isinstance(c, str)}
    if any(c.startswith(TORCH_CHECK) for c in constants):
        return True, "%s's create_default_local_load_plan refuses a saved size that differs from the one asked for" % (
            label
        )
    return False, "%s's load planner does not compare saved and asked sizes" % label


def _class_names(planner: type) -> "set[str]":
    names: "set[str]" = set(vars(planner))
    for _name, member in vars(planner).items():
        for code in code_reading.codes_of(member):
            names |= code_reading.mentions(code)
    return names


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    megatron = versions.megatron_core_label()
    planner = vars(module).get(PLANNER)
    if not isinstance(planner, type) or "create_local_plan" not in vars(planner):
        return Evaluation(Decision(False, "%s has no %s.create_local_plan" % (megatron, PLANNER)))
    names = _class_names(planner)
    if any(name in names for name in OWN_BYPASS):
        reason = "%s's %s lets tensors saved with allow_shape_mismatch past torch's size check itself" % (
            megatron,
            PLANNER,
        )
        return Evaluation(Decision(False, reason), planner)
    if RIGID not in names:
        reason = "%s's %s does not say which tensors it validates itself; not patching" % (megatron, PLANNER)
        return Evaluation(Decision(None, reason), planner)
    compares, why = torch_compares_sizes()
    if compares is None:
        return Evaluation(Decision(None, "%s; not patching" % why), planner)
    if not compares:
        return Evaluation(Decision(False, "%s, as %s expects" % (why, megatron)), planner)
    reason = (
        "%s; %s's %s hands it the tensors saved with allow_shape_mismatch (padded vocabularies, bucket-space "
        "optimizer state), so a resume into another shape fails: they now get the asked size while it plans"
        % (why, megatron, PLANNER)
    )
    return Evaluation(Decision(True, reason), planner)


def asked_sizes_while_planning(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron-core's ``create_local_plan``, with the tensors it does not validate itself
    given the size asked for in the checkpoint metadata while it runs."""

    def create_local_plan(self: Any) -> Any:
        rigid = {getattr(t, "key", None) for t in getattr(self, RIGID, ()) or ()}
        saved = getattr(getattr(self, "metadata", None), "state_dict_metadata", None) or {}
        changed: List[Tuple[Any, Any]] = []
        try:
            for fqn, value in (getattr(self, "state_dict", None) or {}).items():
                entry = saved.get(fqn)
                size = getattr(value, "size", None)
                if fqn in rigid or entry is None or not hasattr(entry, "chunks") or not callable(size):
                    continue
                asked = size()
                if entry.size != asked:
                    changed.append((entry, entry.size))
                    entry.size = asked
            return original(self)
        finally:
            for entry, size in changed:
                entry.size = size

    return methods.marked(create_local_plan, original, "%s.create_local_plan" % PLANNER)


def is_applied(module: ModuleType) -> bool:
    return methods.is_rebound(module, PLANNER, "create_local_plan")


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.planner is None:
        return ev.decision, is_applied(module)
    methods.rebind(ev.planner, "create_local_plan", asked_sizes_while_planning)
    return ev.decision, True
