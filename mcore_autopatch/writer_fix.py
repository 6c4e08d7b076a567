"""The fix: rebind a writer module's ``_write_item`` global to a safe caller of torch's.

The known writers (``mcore_autopatch.writers``: megatron-core's and nvidia-resiliency-ext's
``FileSystemWriterAsync.write_preloaded_data``) look ``_write_item`` up in their module's
globals at call time, so rebinding that one name is the narrowest fix: no megatron, nvrx or
torch function is re-implemented, the class and its methods stay as they are, and forked
write workers inherit the rebinding. The safe caller adds only what a call
lacks, judged per call: a default ``_StorageWriterTransforms()`` in front of the legacy
four-argument call ``(stream, data, write_item, storage_key)``, and
``serialization_format=SerializationFormat.TORCH_SAVE`` by keyword when it was passed
neither by position nor by keyword. A call that is already complete (a job's own shim,
megatron-core 0.13+ under ``force``) passes through unchanged.

``mcore_autopatch.fixes`` lists this fix once per known writer and calls ``apply`` when the
writer module has executed.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional

import mcore_autopatch
from mcore_autopatch import policy, writers

# Set on the safe caller; its value is our version. Checked instead of isinstance, so a
# rebinding made by another copy of this package is recognised too.
MARK = "__mcore_autopatch__"
TORCH_FS_MODULE = "torch.distributed.checkpoint.filesystem"

_lock = threading.Lock()  # guards the rebinding only; nothing is imported under it


def is_safe_write_item(obj: object) -> bool:
    return bool(getattr(obj, MARK, False))


def make_safe_write_item(
    original: Callable[..., Any],
    plan: policy.Plan,
    signature: policy.WriteItemSignature,
    transforms_type: Optional[type],
    torch_save: Any,
) -> Callable[..., Any]:
    """A caller of ``original`` that supplies what ``plan`` says a call may lack."""
    transforms_cls: type = transforms_type or type(None)
    add_transforms = plan.add_transforms and transforms_type is not None
    # One no-extension transforms object, as torch's own writer keeps one per writer.
    default_transforms = transforms_cls() if add_transforms else None
    add_format = plan.add_format
    format_index = signature.format_index
    format_name = policy.FORMAT_PARAM

    legacy_arity = len(policy.LEGACY_PARAMS)

    def _write_item(*args: Any, **kwargs: Any) -> Any:
        # Only the legacy four-argument call gets transforms in front: a call of any other
        # shape is passed on as it is, so this never makes a 6th positional argument (on
        # torch 2.7 that would be safe_tensors, and a truthy one drops the tensor bytes).
        if add_transforms and len(args) == legacy_arity and not isinstance(args[0], transforms_cls):
            args = (default_transforms, *args)
        if add_format and format_name not in kwargs and (format_index is None or len(args) <= format_index):
            kwargs[format_name] = torch_save
        return original(*args, **kwargs)

    _write_item.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(_write_item, MARK, mcore_autopatch.__version__)
    _write_item.__doc__ = "mcore-autopatch: torch's _write_item, with %s supplied when a call lacks it." % (
        " and ".join(n for n, on in (("transforms", add_transforms), (format_name, add_format)) if on)
    )
    return _write_item


def torch_filesystem() -> Optional[ModuleType]:
    module = sys.modules.get(TORCH_FS_MODULE)
    if module is None:
        try:
            import torch.distributed.checkpoint.filesystem as module  # type: ignore[no-redef]
        except Exception:
            return None
    return module


def torch_save_member(fs: Optional[ModuleType]) -> Any:
    return getattr(getattr(fs, "SerializationFormat", None), "TORCH_SAVE", None)


def torch_has(fs: Optional[ModuleType]) -> Callable[[str], bool]:
    def has(name: str) -> bool:
        if name == "SerializationFormat":
            return torch_save_member(fs) is not None
        return isinstance(getattr(fs, name, None), type)

    return has


def torch_version() -> str:
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None)
    return str(version) if version is not None else "(unknown version)"


class Evaluation:
    """The decision for one writer module, with what applying it needs."""

    __slots__ = ("call", "decision", "fs", "original", "signature")

    def __init__(
        self,
        decision: policy.Decision,
        fs: Optional[ModuleType] = None,
        original: Optional[Callable[..., Any]] = None,  # torch's own _write_item
        signature: Optional[policy.WriteItemSignature] = None,
        call: Optional[policy.CallEvidence] = None,  # what the writer's code shows of its call
    ) -> None:
        self.decision = decision
        self.fs = fs
        self.original = original
        self.signature = signature
        self.call = call


def evaluate(writer: ModuleType, mode: str) -> Evaluation:
    """Read torch's signature, the writer's version and its own call, and decide, changing nothing."""
    known = writers.for_module(writer.__name__)
    if known is None:
        unknown = "%s is not a writer mcore-autopatch knows; not patching" % writer.__name__
        return Evaluation(policy.Decision(None, unknown))
    fs = torch_filesystem()
    original = getattr(fs, "_write_item", None)
    if fs is None or original is None:
        return Evaluation(
            policy.Decision(None, "torch.distributed.checkpoint.filesystem has no _write_item; not patching")
        )
    if "_write_item" not in vars(writer):
        return Evaluation(
            policy.Decision(None, "%s has no _write_item global (an upstream rewrite?); not patching" % writer.__name__)
        )
    signature = policy.read_signature(original)
    call = policy.read_call(writer)
    version = policy.writer_version(known)
    decision = policy.decide(mode, version, signature, torch_version(), torch_has(fs), known, call)
    return Evaluation(decision, fs, original, signature, call)


def apply(writer: ModuleType, mode: str) -> "tuple[policy.Decision, bool]":
    """Decide, and rebind ``writer._write_item`` when the decision says so.

    Returns the decision and whether the safe caller is in place afterwards.
    """
    ev = evaluate(writer, mode)
    decision, original = ev.decision, ev.original
    if decision.plan is None or original is None or ev.signature is None:
        return decision, is_safe_write_item(vars(writer).get("_write_item"))
    with _lock:
        current = vars(writer).get("_write_item")
        if is_safe_write_item(current):
            return decision, True  # already ours: never stack a second wrapper
        if current is not original:
            name = "%s.%s" % (getattr(current, "__module__", "?"), getattr(current, "__qualname__", current))
            return policy.Decision(
                decision.needed,
                "%s; but %s._write_item is already %s (a job's own fix?), so it is left alone"
                % (decision.reason, writer.__name__, name),
            ), False
        safe = make_safe_write_item(
            original,
            decision.plan,
            ev.signature,
            getattr(ev.fs, "_StorageWriterTransforms", None),
            torch_save_member(ev.fs),
        )
        writer._write_item = safe  # type: ignore[attr-defined]
    return decision, True


def is_applied(writer: ModuleType) -> bool:
    return is_safe_write_item(vars(writer).get("_write_item"))
