"""Decide whether megatron-core's writer needs the fix, and what exactly it must supply.

Two facts decide, both read from what is installed, never assumed:

* torch's ``_write_item`` signature, by parameter names (``read_signature``):
  ``(stream, data, write_item, storage_key)`` up to torch 2.6; ``transforms`` first from
  2.7 (with an optional ``safe_tensors`` 6th parameter in 2.7 that must never receive an
  argument: a truthy one skips ``torch.save`` and loses the tensor bytes); a required
  ``serialization_format`` from 2.8.
* megatron-core's version (``megatron_core_version``): releases before 0.12 call
  ``_write_item(stream, data, write_item, storage_key)``; 0.12.x add the writer's
  ``transforms`` in front; 0.13 and later pass ``serialization_format`` themselves.

Anything unrecognised means "do not patch" with a reason, because a guess could change
what gets written.
"""

import inspect
import re
import sys
from typing import Any, Callable, NamedTuple, Optional, Tuple

LEGACY_PARAMS = ("stream", "data", "write_item", "storage_key")
FORMAT_PARAM = "serialization_format"
TORCH_27_FLAG = "safe_tensors"
# megatron-core passes serialization_format itself from this release on.
FIXED_IN = (0, 13)
# megatron-core passes the writer's transforms from this release on.
PASSES_TRANSFORMS_FROM = (0, 12)


class WriteItemSignature(NamedTuple):
    """What torch's ``_write_item`` needs beyond the four legacy arguments."""

    text: str
    takes_transforms: bool = False
    format_index: Optional[int] = None  # positional index; None when keyword-only or absent
    has_format: bool = False
    format_required: bool = False
    format_default: Any = None
    problem: Optional[str] = None  # set when the signature is not one we know how to serve

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


# --- megatron-core version -------------------------------------------------------------


def parse_release(version: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``"0.12.1"`` -> ``(0, 12, 1)``; ``None`` for anything that is not a version.

    Uses ``packaging`` (a declared dependency); a plain ``X.Y[.Z]`` reading stands in
    if it has gone missing, so a broken environment does not lose the fix.
    """
    if not version or not isinstance(version, str):
        return None
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
        return tuple(int(g) for g in match.groups() if g is not None) if match else None
    try:
        return tuple(Version(version).release)
    except InvalidVersion:
        return None


class MegatronVersion(NamedTuple):
    version: Optional[str]
    release: Optional[Tuple[int, ...]]
    source: str  # "metadata", "package_info", or why neither worked

    @property
    def known(self) -> bool:
        return self.release is not None


def megatron_core_version() -> MegatronVersion:
    """The installed megatron-core version: its distribution metadata when that metadata
    belongs to the code actually imported, else ``megatron.core.package_info``."""
    meta_version, meta_matches = _from_metadata()
    if meta_version is not None and meta_matches and parse_release(meta_version):
        return MegatronVersion(meta_version, parse_release(meta_version), "metadata")
    info_version = _from_package_info()
    if info_version is not None and parse_release(info_version):
        return MegatronVersion(info_version, parse_release(info_version), "package_info")
    if meta_version is not None and parse_release(meta_version):
        # Metadata of another copy than the one imported; still the best there is.
        return MegatronVersion(meta_version, parse_release(meta_version), "metadata (another copy)")
    return MegatronVersion(
        meta_version or info_version,
        None,
        "neither megatron-core's distribution metadata nor megatron.core.package_info gives a version",
    )


def _metadata_module() -> Any:
    if sys.version_info < (3, 10):
        try:
            import importlib_metadata

            return importlib_metadata
        except ImportError:
            pass
    import importlib.metadata

    return importlib.metadata


def _from_metadata() -> "tuple[Optional[str], bool]":
    """(version, whether that distribution holds the imported megatron.core)."""
    try:
        md = _metadata_module()
        for name in ("megatron-core", "megatron_core"):
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
    return version, _holds_loaded_code(dist)


def _version_header(dist: Any) -> Optional[str]:
    """The ``Version:`` header of ``dist``'s metadata.

    Read from the header lines only: ``dist.version`` parses megatron-core's whole 74 KB
    METADATA (its long description) as an e-mail message, about 1.5 ms of time-to-fix.
    """
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    if text:
        for line in text.splitlines():
            if not line.strip():
                break  # end of the headers
            if line.startswith("Version:"):
                return line[len("Version:") :].strip() or None
        return None
    return dist.version  # type: ignore[no-any-return]


def _holds_loaded_code(dist: Any) -> bool:
    core = sys.modules.get("megatron.core")
    loaded = getattr(core, "__file__", None)
    if not loaded:
        return True  # nothing imported to compare with
    try:
        import os

        candidate = os.fspath(dist.locate_file("megatron/core/__init__.py"))
        return os.path.realpath(candidate) == os.path.realpath(loaded)
    except Exception:
        return True


def _from_package_info() -> Optional[str]:
    try:
        from megatron.core import package_info

        version = getattr(package_info, "__version__", None)
        return version if isinstance(version, str) else None
    except Exception:
        return None


# --- the decision ----------------------------------------------------------------------


class Plan(NamedTuple):
    """What the safe ``_write_item`` adds to a call that lacks it."""

    add_transforms: bool
    add_format: bool


class Decision(NamedTuple):
    needed: Optional[bool]  # None: cannot tell
    reason: str
    plan: Optional[Plan] = None  # set when the fix should be applied


def decide(
    mode: str,
    megatron: MegatronVersion,
    signature: WriteItemSignature,
    torch_version: str,
    torch_has: "Callable[[str], bool]",
) -> Decision:
    """Whether to patch, and how. ``torch_has(name)`` tells whether torch's filesystem
    module has ``SerializationFormat`` / ``_StorageWriterTransforms``."""
    torch_label = "torch %s" % torch_version
    if signature.problem:
        return Decision(None, "%s: %s; not patching" % (torch_label, signature.problem))
    supply_format = signature.has_format and (signature.format_required or not _is_torch_save(signature.format_default))
    if not signature.takes_transforms and not supply_format:
        return Decision(
            False, "%s's %s is called correctly by every megatron-core release" % (torch_label, signature.text)
        )
    mcore_label = "megatron-core %s" % (megatron.version or "(unknown version)")
    missing = []
    if mode == "force":
        # Skip the version gate: supply whatever torch requires and a call lacks.
        if signature.takes_transforms and torch_has("_StorageWriterTransforms"):
            missing.append("transforms")
        if supply_format:
            missing.append(FORMAT_PARAM)
        if not missing:
            return Decision(None, "MCORE_AUTOPATCH=force, but torch has nothing to supply; not patching")
        prefix = "MCORE_AUTOPATCH=force: supplying %s where a call lacks it (%s)" % (
            " and ".join(missing),
            mcore_label,
        )
    else:
        if not megatron.known:
            return Decision(None, "%s; set MCORE_AUTOPATCH=force to patch anyway" % megatron.source)
        release = megatron.release or ()
        if release[:2] >= FIXED_IN:
            return Decision(False, "%s passes %s itself" % (mcore_label, FORMAT_PARAM))
        if signature.takes_transforms and release[:2] < PASSES_TRANSFORMS_FROM:
            missing.append("transforms")
        if supply_format:
            missing.append(FORMAT_PARAM)
        if not missing:
            return Decision(False, "%s passes everything %s's _write_item requires" % (mcore_label, torch_label))
        prefix = "%s calls _write_item without %s; %s requires %s" % (
            mcore_label,
            " and ".join(missing),
            torch_label,
            "it" if len(missing) == 1 else "them",
        )
    for needs, name in (("transforms", "_StorageWriterTransforms"), (FORMAT_PARAM, "SerializationFormat")):
        if needs in missing and not torch_has(name):
            return Decision(True, "%s, but torch has no %s to supply; not patching" % (prefix, name))
    return Decision(True, prefix, Plan("transforms" in missing, FORMAT_PARAM in missing))


def _is_torch_save(value: Any) -> bool:
    return getattr(value, "name", None) == "TORCH_SAVE" or value == "torch_save"
