"""Decide whether a known writer needs the fix, and what exactly it must supply.

Three facts decide, all read from what is installed, never assumed:

* torch's ``_write_item`` signature, by parameter names (``read_signature``):
  ``(stream, data, write_item, storage_key)`` up to torch 2.6; ``transforms`` first from
  2.7 (with an optional ``safe_tensors`` 6th parameter in 2.7 that must never receive an
  argument: a truthy one skips ``torch.save`` and loses the tensor bytes); a required
  ``serialization_format`` from 2.8.
* the writer's version (``writer_version``; the releases are in ``writers``): megatron-core
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
import re
import sys
from types import CodeType, ModuleType
from typing import Any, Callable, Optional, Tuple

from mcore_autopatch._record import Record
from mcore_autopatch.writers import MEGATRON_CORE, KnownWriter

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


# --- the writer's version --------------------------------------------------------------


# A version in its canonical PEP 440 form ("0.12.1", "0.13.0rc0", "0.12.1.dev0+mindspeed"):
# its release numbers are read without importing packaging (a millisecond at the watched
# import of a release that has not imported it itself). Compiled on first use: a plain
# "0.12.1", what releases carry, needs no pattern (0.3 ms to compile at a watched import).
_CANONICAL = r"^(\d+(?:\.\d+)*)(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?(?:\+[a-z0-9]+(?:\.[a-z0-9]+)*)?$"


def parse_release(version: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``"0.12.1"`` -> ``(0, 12, 1)``; ``None`` for anything that is not a version.

    Uses ``packaging`` (a declared dependency); a plain ``X.Y[.Z]`` reading stands in
    if it has gone missing, so a broken environment does not lose the fix.
    """
    if not version or not isinstance(version, str):
        return None
    parts = version.split(".")
    if all(part.isascii() and part.isdigit() for part in parts):
        return tuple(int(part) for part in parts)
    canonical = re.match(_CANONICAL, version)
    if canonical:  # what metadata holds; packaging reads the same release from it
        return tuple(int(part) for part in canonical.group(1).split("."))
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
        return tuple(int(g) for g in match.groups() if g is not None) if match else None
    try:
        return tuple(Version(version).release)
    except InvalidVersion:
        return None


class WriterVersion(Record):
    """``source``: "metadata", "package_info", or why neither worked."""

    __slots__ = ("release", "source", "version")

    def __init__(self, version: Optional[str], release: Optional[Tuple[int, ...]], source: str) -> None:
        self.version = version
        self.release = release
        self.source = source

    @property
    def known(self) -> bool:
        return self.release is not None


# writer name -> (weak references to its top package and its module as imported, the version
# read for them):
# several fixes of one library ask in the same import, and reading metadata costs ~0.4 ms.
_versions: "dict[str, tuple[Any, Any, WriterVersion, bool]]" = {}


def megatron_core_label() -> str:
    """ "megatron-core 0.12.1": how every fix names the release in its reasons."""
    return "megatron-core %s" % (writer_version(MEGATRON_CORE).version or "(unknown version)")


def writer_version(writer: KnownWriter) -> WriterVersion:
    """The installed version of ``writer``'s distribution: its metadata when that metadata
    belongs to the code actually imported, else its ``package_info`` module. Read again
    whenever the imported package or module is another object (a re-import, a new tree); a
    writer module imported after the version was read (megatron-core's model code imports
    first) keeps it: the read compared the metadata with the package imported then."""
    import weakref

    top = sys.modules.get(writer.module.split(".")[0])
    module = sys.modules.get(writer.module)
    cached = _versions.get(writer.name)
    if cached is not None and top is not None and cached[0]() is top:
        cached_module = cached[1]()
        if cached_module is module or (cached_module is None and cached[3]):
            if cached_module is None and module is not None:
                _versions[writer.name] = (cached[0], weakref.ref(module), cached[2], False)
            return cached[2]
    version = _read_writer_version(writer)
    try:
        _versions[writer.name] = (
            weakref.ref(top),
            weakref.ref(module) if module is not None else lambda: None,
            version,
            module is None,  # read before the writer module was imported
        )
    except TypeError:  # not a module object (a test's stand-in): read it every time
        _versions.pop(writer.name, None)
    return version


def _read_writer_version(writer: KnownWriter) -> WriterVersion:
    meta_version, meta_matches = _from_metadata(writer)
    if meta_version is not None and meta_matches and parse_release(meta_version):
        return WriterVersion(meta_version, parse_release(meta_version), "metadata")
    info_version = _from_package_info(writer.package_info)
    if info_version is not None and parse_release(info_version):
        return WriterVersion(info_version, parse_release(info_version), "package_info")
    if meta_version is not None and parse_release(meta_version):
        # Metadata of another copy than the one imported; still the best there is.
        return WriterVersion(meta_version, parse_release(meta_version), "metadata (another copy)")
    if writer.package_info:
        why = "neither %s's distribution metadata nor %s gives a version" % (writer.name, writer.package_info)
    else:
        why = "%s's distribution metadata gives no version" % writer.name
    return WriterVersion(meta_version or info_version, None, why)


def _metadata_module() -> Any:
    if sys.version_info < (3, 10):
        try:
            import importlib_metadata

            return importlib_metadata
        except ImportError:
            pass
    import importlib.metadata

    return importlib.metadata


def _from_metadata(writer: KnownWriter) -> "tuple[Optional[str], bool]":
    """(version, whether that distribution holds the imported code of ``writer``)."""
    try:
        md = _metadata_module()
        for name in writer.distributions:
            try:
                dist = md.distribution(name)
                break
            except md.PackageNotFoundError:
                continue
        else:
            return None, False
        version = _version_header(dist)
        if not isinstance(version, str):
            return None, False
    except Exception:
        return None, False
    return version, _holds_loaded_code(dist, writer.module)


def _version_header(dist: Any) -> Optional[str]:
    """The ``Version:`` header of ``dist``'s metadata.

    Read from the header lines only: ``dist.version`` parses megatron-core's whole 74 KB
    METADATA (its long description) as an e-mail message, about 1.5 ms of time-to-fix.
    """
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    if text:
        headers = text.partition("\n\n")[0]  # not the long description's lines (read as text: "\n" only)
        for line in headers.splitlines():
            if not line.strip():
                break  # end of the headers
            if line.startswith("Version:"):
                return line[len("Version:") :].strip() or None
        return None
    return dist.version  # type: ignore[no-any-return]


def _holds_loaded_code(dist: Any, module_name: str) -> bool:
    """Whether ``dist`` holds the file of ``module_name`` (or of its nearest imported
    package) that this process actually imported."""
    import os

    parts = module_name.split(".")
    for depth in range(len(parts), 0, -1):
        loaded = getattr(sys.modules.get(".".join(parts[:depth])), "__file__", None)
        if not loaded:
            continue  # not imported yet, or a namespace package
        relative, name = os.path.join(*parts[:depth]), os.path.basename(loaded)
        if name.startswith("__init__."):
            relative = os.path.join(relative, name)  # a package
        else:
            relative += os.path.splitext(name)[1]
        try:
            candidate = os.fspath(dist.locate_file(relative))
            # The same file (two stats; realpath would lstat every folder of both paths).
            return os.path.samefile(candidate, loaded)
        except FileNotFoundError:
            return False  # the distribution lists a file that is not there: another copy
        except Exception:
            return True
    return True  # nothing imported to compare with


def _from_package_info(module_name: Optional[str]) -> Optional[str]:
    if not module_name:
        return None
    try:
        import importlib

        version = getattr(importlib.import_module(module_name), "__version__", None)
        return version if isinstance(version, str) else None
    except Exception:
        return None


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
    from mcore_autopatch import code_reading

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


class Decision(Record):
    """``needed`` is None when it cannot be told; ``plan`` is set when the fix should be
    applied. ``where``, for a fix over several modules: which module (and functions) the
    reason is about, so that status states one reason once for all the modules it holds for."""

    __slots__ = ("needed", "plan", "reason", "where")

    def __init__(self, needed: Optional[bool], reason: str, plan: Optional[Plan] = None, where: str = "") -> None:
        self.needed = needed
        self.reason = reason
        self.plan = plan
        self.where = where


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
