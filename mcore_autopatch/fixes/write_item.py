"""The fix: rebind a writer module's ``_write_item`` global to a safe caller of torch's.

The known writers (``shared/writers.py``: megatron-core's and nvidia-resiliency-ext's
``FileSystemWriterAsync.write_preloaded_data``) look ``_write_item`` up in their module's
globals at call time, so rebinding that one name is the narrowest fix: no megatron, nvrx or
torch function is re-implemented, the class and its methods stay as they are, and forked
write workers inherit the rebinding. The safe caller adds only what a call
lacks, judged per call: a default ``_StorageWriterTransforms()`` in front of the legacy
four-argument call ``(stream, data, write_item, storage_key)``, and
``serialization_format=SerializationFormat.TORCH_SAVE`` by keyword when it was passed
neither by position nor by keyword. A call that is already complete (a job's own shim,
megatron-core 0.13+ under ``force``) passes through unchanged.

The table (``mcore_autopatch.fixes``) lists this fix once per known writer
(``shared/writers.py``) and calls ``apply`` when the writer module has executed.

How it decides, from what is installed, never assumed:

* torch's ``_write_item`` signature, by parameter names (``read_signature``):
  ``(stream, data, write_item, storage_key)`` up to torch 2.6; ``transforms`` first from
  2.7 (with an optional ``safe_tensors`` 6th parameter in 2.7 that must never receive an
  argument: a truthy one skips ``torch.save`` and loses the tensor bytes); a required
  ``serialization_format`` from 2.8.
* the writer's version (``shared/versions.py``; the releases are in ``shared/writers.py``): megatron-core
  before 0.12 calls ``_write_item(stream, data, write_item, storage_key)``, 0.12.x add the
  writer's ``transforms`` in front, 0.13 and later pass ``serialization_format`` themselves;
  nvidia-resiliency-ext 0.3.0 calls it as megatron-core 0.12 does, 0.4 passes it.
* the writer's own call (``read_call``): whether the code that calls ``_write_item`` names
  ``serialization_format`` at all. It overrules the version for that argument, so that a
  development tree already labelled 0.13.0rc0 but still making the old call is fixed.

Anything unrecognised means "do not patch" with a reason, because a guess could change
what gets written.
"""

from __future__ import annotations

import inspect
import sys
import threading
from types import CodeType, ModuleType
from typing import Any, Callable, Optional, Tuple

import mcore_autopatch
from mcore_autopatch.shared import versions, writers
from mcore_autopatch.shared.values import Decision, Record
from mcore_autopatch.shared.versions import WriterVersion
from mcore_autopatch.shared.writers import MEGATRON_CORE, KnownWriter

LEGACY_PARAMS = ("stream", "data", "write_item", "storage_key")
FORMAT_PARAM = "serialization_format"
TORCH_27_FLAG = "safe_tensors"


class WriteItemSignature(Record):
    """What torch's ``_write_item`` needs beyond the four legacy arguments.

    ``format_index`` is the positional index of ``serialization_format`` (None when it is
    keyword-only or absent); ``problem`` is set when the signature is not one we know how
    to serve."""

    __slots__ = (
        "format_default",
        "format_index",
        "format_required",
        "has_format",
        "problem",
        "takes_transforms",
        "text",
    )

    def __init__(
        self,
        text: str,
        takes_transforms: bool = False,
        format_index: Optional[int] = None,
        has_format: bool = False,
        format_required: bool = False,
        format_default: Any = None,
        problem: Optional[str] = None,
    ) -> None:
        self.text = text
        self.takes_transforms = takes_transforms
        self.format_index = format_index
        self.has_format = has_format
        self.format_required = format_required
        self.format_default = format_default
        self.problem = problem

    @property
    def generation(self) -> str:
        if self.problem:
            return "unrecognised"
        if not self.takes_transforms:
            return "torch<=2.6"
        if self.has_format:
            return "torch>=2.8"
        return "torch 2.7"


def read_signature(write_item: Callable[..., Any]) -> WriteItemSignature:
    """Classify torch's ``_write_item`` by its parameters."""
    try:
        sig = inspect.signature(write_item)
    except (TypeError, ValueError) as exc:
        return WriteItemSignature("?", problem="cannot read the signature of _write_item: %s" % exc)
    text = "_write_item%s" % _plain_signature(sig)
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return WriteItemSignature(text, problem="%s takes *args or **kwargs; its needs cannot be read" % text)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(positional[:4]) == LEGACY_PARAMS:
        head, rest = 4, params[4:]
        takes_transforms = False
    elif positional[:1] == ["transforms"] and tuple(positional[1:5]) == LEGACY_PARAMS:
        head, rest = 5, params[5:]
        takes_transforms = True
    else:
        return WriteItemSignature(text, problem="%s does not start with the parameters megatron-core passes" % text)
    if takes_transforms and params[0].default is not params[0].empty:
        takes_transforms = False  # a future torch with a default for it: nothing to supply
    fields = {"takes_transforms": takes_transforms}
    for index, p in enumerate(rest, start=head):
        if p.name == FORMAT_PARAM:
            fields.update(
                has_format=True,
                format_required=p.default is p.empty,
                format_default=None if p.default is p.empty else p.default,
                format_index=index if p.kind is p.POSITIONAL_OR_KEYWORD else None,
            )
        elif p.default is p.empty:
            return WriteItemSignature(
                text,
                problem="%s has a required parameter %r that mcore-autopatch does not know" % (text, p.name),
            )
        # else: an optional parameter such as torch 2.7's safe_tensors; never passed.
    return WriteItemSignature(text, **fields)


def _plain_signature(sig: inspect.Signature) -> str:
    """``(transforms, stream, ...)`` without annotations, for messages (``*args``, ``*, x`` kept)."""
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


# --- the writer's own call -------------------------------------------------------------

FORMAT_NAMES = frozenset((FORMAT_PARAM, "SerializationFormat"))


class CallEvidence(Record):
    """What the writer module's code shows of its ``_write_item`` calls.

    Read from the code objects of the module's functions and methods (no file is read): a
    function calls ``_write_item`` when the name is among the names its code loads, and it
    passes ``serialization_format`` when its code names the argument or torch's enum
    (megatron-core 0.13 and nvidia-resiliency-ext 0.4 build the keyword from the string).
    ``callers``: the qualified names of the functions that call ``_write_item``;
    ``without_format``: those of them whose code never names the format.
    """

    __slots__ = ("callers", "without_format")

    def __init__(self, callers: Tuple[str, ...] = (), without_format: Tuple[str, ...] = ()) -> None:
        self.callers = callers
        self.without_format = without_format

    @property
    def passes_format(self) -> Optional[bool]:
        """None when no caller was found (the version alone decides then)."""
        return None if not self.callers else not self.without_format

    @property
    def text(self) -> str:
        if not self.callers:
            return "no function calling _write_item found in its code"
        if self.without_format:
            return "%s calls _write_item without %s" % (", ".join(self.without_format), FORMAT_PARAM)
        return "%s passes %s" % (", ".join(self.callers), FORMAT_PARAM)


NO_CALL_FOUND = CallEvidence()


def read_call(module: ModuleType) -> CallEvidence:
    """How the functions defined in ``module`` call ``_write_item``. A module whose members
    cannot be walked gives no evidence (the version alone decides then), never an error."""
    from mcore_autopatch.shared import code_reading

    codes: "dict[str, list[CodeType]]" = {}  # a function and what its decorators wrap, together
    try:
        for qualname, code in code_reading.defined_functions(module):
            codes.setdefault(qualname, []).append(code)
        callers = [
            qualname
            for qualname, chain in codes.items()
            if any("_write_item" in nested.co_names for code in chain for nested in code_reading.nested(code))
        ]
        lacking = [
            qualname
            for qualname in callers
            if FORMAT_NAMES.isdisjoint(name for code in codes[qualname] for name in code_reading.mentions(code))
        ]
    except Exception:
        return NO_CALL_FOUND
    return CallEvidence(tuple(callers), tuple(lacking))


# --- the decision ----------------------------------------------------------------------


class Plan(Record):
    """What the safe ``_write_item`` adds to a call that lacks it."""

    __slots__ = ("add_format", "add_transforms")

    def __init__(self, add_transforms: bool, add_format: bool) -> None:
        self.add_transforms = add_transforms
        self.add_format = add_format


def decide(
    mode: str,
    version: WriterVersion,
    signature: WriteItemSignature,
    torch_version: str,
    torch_has: "Callable[[str], bool]",
    writer: KnownWriter = MEGATRON_CORE,
    call: CallEvidence = NO_CALL_FOUND,
) -> Decision:
    """Whether to patch ``writer``, and how.

    ``torch_has(name)`` tells whether torch's filesystem module has ``SerializationFormat`` /
    ``_StorageWriterTransforms``. Whether the writer passes ``serialization_format`` is read
    from its code (``call``) when a caller was found there, else from its version; so a
    source tree whose version claims the fix while its writer makes the old call is fixed,
    and one that carries the fix under an older version is left alone.
    """
    torch_label = "torch %s" % torch_version
    if signature.problem:
        return Decision(None, "%s: %s; not patching" % (torch_label, signature.problem))
    supply_format = signature.has_format and (signature.format_required or not _is_torch_save(signature.format_default))
    if not signature.takes_transforms and not supply_format:
        return Decision(
            False, "%s's %s is called correctly by every %s release" % (torch_label, signature.text, writer.name)
        )
    label = "%s %s" % (writer.name, version.version or "(unknown version)")
    missing = []
    if mode == "force":
        # Skip the version gate: supply whatever torch requires and a call lacks.
        if signature.takes_transforms and torch_has("_StorageWriterTransforms"):
            missing.append("transforms")
        if supply_format:
            missing.append(FORMAT_PARAM)
        if not missing:
            return Decision(None, "MCORE_AUTOPATCH=force, but torch has nothing to supply; not patching")
        prefix = "MCORE_AUTOPATCH=force: supplying %s where a call lacks it (%s)" % (" and ".join(missing), label)
    else:
        if not version.known:
            return Decision(None, "%s; set MCORE_AUTOPATCH=force to patch anyway" % version.source)
        release = version.release or ()
        by_version = release[: len(writer.fixed_in)] >= writer.fixed_in
        passes_format = by_version if call.passes_format is None else call.passes_format
        passes_transforms = release[: len(writer.passes_transforms_from)] >= writer.passes_transforms_from
        note = ""
        if passes_format != by_version:
            note = " (read from its writer's code, %s; by its version alone it would %s)" % (
                ", ".join(call.without_format or call.callers),
                "pass it" if by_version else "not",
            )
        if passes_format and (passes_transforms or not signature.takes_transforms):
            return Decision(False, "%s passes %s itself%s" % (label, FORMAT_PARAM, note))
        if signature.takes_transforms and not passes_transforms:
            missing.append("transforms")
        if supply_format and not passes_format:
            missing.append(FORMAT_PARAM)
        if not missing:
            return Decision(False, "%s passes everything %s's _write_item requires" % (label, torch_label))
        prefix = "%s calls _write_item without %s; %s requires %s%s" % (
            label,
            " and ".join(missing),
            torch_label,
            "it" if len(missing) == 1 else "them",
            note,
        )
    for needs, name in (("transforms", "_StorageWriterTransforms"), (FORMAT_PARAM, "SerializationFormat")):
        if needs in missing and not torch_has(name):
            return Decision(True, "%s, but torch has no %s to supply; not patching" % (prefix, name))
    return Decision(True, prefix, Plan("transforms" in missing, FORMAT_PARAM in missing))


def _is_torch_save(value: Any) -> bool:
    return getattr(value, "name", None) == "TORCH_SAVE" or value == "torch_save"


# --- the rebinding ---------------------------------------------------------------------

# Set on the safe caller; its value is our version. Checked instead of isinstance, so a
# rebinding made by another copy of this package is recognised too.
MARK = "__mcore_autopatch__"
TORCH_FS_MODULE = "torch.distributed.checkpoint.filesystem"

_lock = threading.Lock()  # guards the rebinding only; nothing is imported under it


def is_safe_write_item(obj: object) -> bool:
    return bool(getattr(obj, MARK, False))


def make_safe_write_item(
    original: Callable[..., Any],
    plan: Plan,
    signature: WriteItemSignature,
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
    format_name = FORMAT_PARAM

    legacy_arity = len(LEGACY_PARAMS)

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


class Evaluation:
    """The decision for one writer module, with what applying it needs."""

    __slots__ = ("call", "decision", "fs", "original", "signature")

    def __init__(
        self,
        decision: Decision,
        fs: Optional[ModuleType] = None,
        original: Optional[Callable[..., Any]] = None,  # torch's own _write_item
        signature: Optional[WriteItemSignature] = None,
        call: Optional[CallEvidence] = None,  # what the writer's code shows of its call
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
        return Evaluation(Decision(None, unknown))
    fs = torch_filesystem()
    original = getattr(fs, "_write_item", None)
    if fs is None or original is None:
        return Evaluation(Decision(None, "torch.distributed.checkpoint.filesystem has no _write_item; not patching"))
    if "_write_item" not in vars(writer):
        return Evaluation(
            Decision(None, "%s has no _write_item global (an upstream rewrite?); not patching" % writer.__name__)
        )
    signature = read_signature(original)
    call = read_call(writer)
    version = versions.writer_version(known)
    decision = decide(mode, version, signature, versions.torch_version(), torch_has(fs), known, call)
    return Evaluation(decision, fs, original, signature, call)


def apply(writer: ModuleType, mode: str) -> "tuple[Decision, bool]":
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
            return Decision(
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
