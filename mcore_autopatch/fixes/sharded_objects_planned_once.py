"""megatron-core 0.6 - 0.8 plan each ShardedObject twice on torch 2.4 and later.

megatron-core saves a ShardedObject (Megatron-LM's ``rng_state``, the optimizer's
``param_groups`` ...) as a ``BytesIO`` in torch's plan. Up to torch 2.3,
``create_default_local_save_plan`` planned non-tensor values on the coordinator rank only, so
megatron-core 0.6 - 0.8's ``MCoreSavePlanner._add_non_coordinator_iobytes_request`` added them
on the other ranks. From torch 2.4 torch plans them on every rank, so they are planned twice,
and on every rank: those releases pass ``is_coordinator`` to ``set_up_planner`` by position,
where torch 2.4 put ``storage_meta``, so no rank believes it is the coordinator. The global
plan then refuses the duplicate (``AssertionError: item.index.fqn not in md`` on current
torch): no checkpoint with a ShardedObject can be saved. 0.9 plans them itself.

What is read: whether the installed megatron-core's ``MCoreSavePlanner`` defines
``_add_non_coordinator_iobytes_request``, and whether torch's own
``create_default_local_save_plan`` plans a ``BytesIO`` on a non-coordinator rank (asked with
a one-entry state dict: a pure function, nothing is written). What is rebound, only when both
say so: that method of megatron-core's class, to one that calls it only when the plan lacks
a request for one of the rank's objects, so each object is planned once, as on torch 2.3.
"""

from __future__ import annotations

import io
import sys
from types import ModuleType
from typing import Any, Callable, Optional

from mcore_autopatch.shared import methods, versions
from mcore_autopatch.shared.values import Decision

NAME = "sharded_objects_planned_once"
PLANNER = "MCoreSavePlanner"
METHOD = "_add_non_coordinator_iobytes_request"
TORCH_PLANNER_MODULE = "torch.distributed.checkpoint.default_planner"


class Evaluation:
    __slots__ = ("decision", "planner")

    def __init__(
        self,
        decision: Decision,
        planner: Optional[type] = None,
    ) -> None:
        self.decision = decision
        self.planner = planner


def torch_plans_objects_on_every_rank() -> "tuple[Optional[bool], str]":
    """Whether torch's ``create_default_local_save_plan`` plans a BytesIO on a rank that is
    not the coordinator, asked of torch itself."""
    label = "torch %s" % versions.torch_version()
    planner_module = sys.modules.get(TORCH_PLANNER_MODULE)
    plan = getattr(planner_module, "create_default_local_save_plan", None)
    if plan is None:
        return None, "%s has no create_default_local_save_plan" % label
    try:
        items = plan({"mcore_autopatch.probe": io.BytesIO()}, False).items
    except Exception as exc:
        return None, "%s's create_default_local_save_plan cannot be asked (%s)" % (label, exc)
    if any(getattr(item.index, "fqn", None) == "mcore_autopatch.probe" for item in items):
        return True, "%s's create_default_local_save_plan plans them on every rank" % label
    return False, "%s plans them on the coordinator only" % label


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    megatron = versions.megatron_core_label()
    planner = vars(module).get(PLANNER)
    if not isinstance(planner, type) or METHOD not in vars(planner):
        return Evaluation(Decision(False, "%s plans its ShardedObjects itself" % megatron))
    every_rank, why = torch_plans_objects_on_every_rank()
    adds = "%s's %s.%s adds a write request for each ShardedObject on ranks it takes for non-coordinators" % (
        megatron,
        PLANNER,
        METHOD,
    )
    if every_rank is None:
        return Evaluation(Decision(None, "%s; %s; not patching" % (adds, why)), planner)
    if not every_rank:
        return Evaluation(Decision(False, "%s; %s, as that release expects" % (adds, why)), planner)
    reason = (
        "%s (every rank: it passes is_coordinator where torch 2.4+ takes storage_meta); %s, so each is planned "
        "twice and the save fails: the method now adds only the requests the plan lacks" % (adds, why)
    )
    return Evaluation(Decision(True, reason), planner)


def adding_only_what_is_missing(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron-core's own method, called only when the plan lacks one of the rank's objects."""

    def _add_non_coordinator_iobytes_request(self: Any, plan: Any) -> Any:
        planned = {getattr(item.index, "fqn", None) for item in plan.items}
        if all(fqn in planned for fqn, obj in self.state_dict.items() if isinstance(obj, io.BytesIO)):
            return None  # torch planned every object of this rank already
        return original(self, plan)

    return methods.marked(_add_non_coordinator_iobytes_request, original, "%s.%s" % (PLANNER, METHOD))


def is_applied(module: ModuleType) -> bool:
    return methods.is_rebound(module, PLANNER, METHOD)


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.planner is None:
        return ev.decision, is_applied(module)
    methods.rebind(ev.planner, METHOD, adding_only_what_is_missing)
    return ev.decision, True
