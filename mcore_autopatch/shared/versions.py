"""The installed version of a library the fixes read: metadata that belongs to the imported code.

Every fix names the release it judged in its reasons ("megatron-core 0.12.1"); the
``write_item`` fix also decides from it. The version comes from the distribution's metadata
when that metadata holds the very files this process imported, else from the library's own
``package_info`` module (source trees without metadata), and is read once per import of the
package: reading metadata costs about 0.4 ms.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Optional, Tuple

from mcore_autopatch.shared.values import Record
from mcore_autopatch.shared.writers import KNOWN_WRITERS, MEGATRON_CORE, KnownWriter, for_module

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


def torch_version() -> str:
    """The imported torch's version ("2.13.0+cpu"), as every fix names it in its reasons."""
    version = getattr(sys.modules.get("torch"), "__version__", None)
    return str(version) if version is not None else "(unknown version)"


def writer_label(writer: KnownWriter) -> str:
    """ "nvidia-resiliency-ext 0.4.1": how a fix names the release of a writer it reads."""
    return "%s %s" % (writer.name, writer_version(writer).version or "(unknown version)")


def module_label(module_name: str) -> str:
    """The release of the library ``module_name`` (its writer or async module) belongs to, or
    the module's name."""
    known = for_module(module_name) or next((w for w in KNOWN_WRITERS if w.async_module == module_name), None)
    return module_name if known is None else writer_label(known)


def megatron_core_label() -> str:
    """ "megatron-core 0.12.1": how every fix names the release in its reasons."""
    return writer_label(MEGATRON_CORE)


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
