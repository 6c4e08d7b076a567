"""``status()``: what mcore-autopatch sees and decided in this interpreter, and ``check``.

Read-only: it never applies the fix itself. With ``import_writer`` it imports
megatron-core's writer module the normal way, so an active hook fires exactly as it would
in a training job, and the answer reflects this interpreter as it was started.
"""

import contextlib
import importlib
import os
import site
import sys
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import mcore_autopatch
from mcore_autopatch import policy

STARTUP_FILES = ("mcore_autopatch.pth", "mcore_autopatch.start")

# check's exit codes
ACTIVE_OR_NOT_NEEDED, NEEDED_NOT_ACTIVE, CANNOT_TELL = 0, 1, 2


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Hide the deprecation notices megatron-core prints when imported (noise in build logs)."""
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning, UserWarning):
            warnings.simplefilter("ignore", category)
        yield


def site_dirs() -> List[str]:
    """The folders whose ``.pth`` files Python processes at startup."""
    dirs: List[str] = []
    try:
        dirs.extend(site.getsitepackages())
    except Exception:  # some embedded or old virtualenv site modules lack it
        pass
    try:
        if site.ENABLE_USER_SITE:
            dirs.append(site.getusersitepackages())
    except Exception:
        pass
    return dirs


def package_root() -> str:
    """The folder (or zip archive) the ``mcore_autopatch`` package was imported from."""
    return os.path.dirname(os.path.dirname(os.path.abspath(mcore_autopatch.__file__)))


def zip_archive() -> Optional[str]:
    """The zip archive (a zipapp, a ``.pyz`` or ``.zip`` on ``sys.path``) holding the package, if any."""
    root = package_root()
    return root if os.path.isfile(root) else None


def startup_file() -> Tuple[Optional[str], bool]:
    """Our ``.pth`` file and whether Python processes its folder at startup.

    Looked for in the site folders first (a normal or editable install), then beside the
    package (``pip install --target``, ``PYTHONPATH``), where it is not processed. Inside a
    zip archive there is nothing to find: Python never reads ``.pth`` files from one.
    """
    processed = not sys.flags.no_site
    for folder in site_dirs():
        path = os.path.join(folder, STARTUP_FILES[0])
        if os.path.isfile(path):
            return path, processed
    path = os.path.join(package_root(), STARTUP_FILES[0])
    if os.path.isfile(path):
        return path, False
    return None, False


def installed_by(finder: Any, pth: Optional[str], pth_processed: bool) -> Optional[str]:
    """What put the finder on ``sys.meta_path``: a startup file's path, or ``install()``."""
    if finder is None:
        return None
    source = getattr(finder, "activated_by", None)
    if source != "startup":
        return "mcore_autopatch.%s" % source if source == "install()" else str(source)
    if pth is None or not pth_processed:
        return "a startup file"  # e.g. another copy's .pth; ours was not processed
    start = os.path.join(os.path.dirname(pth), STARTUP_FILES[1])
    if sys.version_info >= (3, 15) and os.path.isfile(start):
        return start  # PEP 829: the .start entry point runs instead of the .pth import line
    return pth


def _dist_version(name: str) -> Optional[str]:
    try:
        return str(policy._metadata_module().version(name))
    except Exception:
        return None


def torch_version() -> Optional[str]:
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "")) or None
    return _dist_version("torch")


def _import_writer() -> Tuple[Optional[Any], Optional[str], Optional[str]]:
    """(module, problem, missing top-level name) after trying to import the writer."""
    try:
        return importlib.import_module(mcore_autopatch.WRITER_MODULE), None, None
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        return None, "%s: %s" % (type(exc).__name__, exc), missing
    except Exception as exc:
        return None, "%s: %s" % (type(exc).__name__, exc), None


def status(import_writer: bool = False) -> Dict[str, Any]:
    mode, recognised = mcore_autopatch.read_mode()
    finder = mcore_autopatch.installed_finder()
    pth, pth_processed = startup_file()
    info: Dict[str, Any] = {
        "version": mcore_autopatch.__version__,
        "enabled": mode != "off",
        "mode": mode,
        "mode_env": os.environ.get("MCORE_AUTOPATCH"),
        "mode_recognised": recognised,
        "hook_installed": finder is not None,
        "activated_by": getattr(finder, "activated_by", None),
        "installed_by": installed_by(finder, pth, pth_processed),
        "startup_file": pth,
        "startup_file_processed": pth_processed,
        "zip_archive": zip_archive(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "pid": os.getpid(),
        "torch": None,
        "megatron_core": None,
        "megatron_core_source": None,
        "writer_imported": mcore_autopatch.WRITER_MODULE in sys.modules,
        "torch_write_item": None,
        "needed": None,
        "applied": False,
        "reason": "",
        "advice": None,
        "missing": None,
        "hook_decision": None,
    }
    writer = sys.modules.get(mcore_autopatch.WRITER_MODULE)
    problem = None
    if writer is None and import_writer:
        writer, problem, info["missing"] = _import_writer()
    info["torch"] = torch_version()
    mver = policy.megatron_core_version()
    info["megatron_core"] = mver.version
    info["megatron_core_source"] = mver.source if mver.version else None
    if writer is None:
        if problem is None:
            info["reason"] = "megatron-core's writer module is not imported in this process (yet)"
        elif info["missing"] == "megatron":
            info["needed"] = False
            info["reason"] = "megatron-core is not installed in this interpreter: nothing to fix"
        elif info["missing"] == "torch":
            info["reason"] = (
                "torch is not importable in this interpreter (%s), so neither its _write_item nor "
                "megatron-core's writer can be read" % problem
            )
        else:
            info["reason"] = "cannot import megatron-core's writer module: %s" % problem
        info["advice"] = _advice(info, finder)
        return info

    from mcore_autopatch import writer_fix

    ev = writer_fix.evaluate(writer, "auto" if mode == "off" else mode)
    info["writer_imported"] = True
    info["torch_write_item"] = ev.signature.text if ev.signature else None
    info["needed"] = ev.decision.needed
    info["applied"] = writer_fix.is_safe_write_item(vars(writer).get("_write_item"))
    current = vars(writer).get("_write_item")
    reason = ev.decision.reason
    if ev.decision.needed and not info["applied"] and ev.original is not None and current is not ev.original:
        reason += "; %s._write_item has been replaced by %s" % (writer.__name__, _name(current))
    info["reason"] = reason
    info["hook_decision"] = writer_fix.last_decision()  # what the hook itself decided at import
    info["advice"] = _advice(info, finder)
    return info


def _name(obj: Any) -> str:
    return "%s.%s" % (getattr(obj, "__module__", "?"), getattr(obj, "__qualname__", repr(obj)))


def _advice(info: Dict[str, Any], finder: Any) -> Optional[str]:
    """Why the hook is not active in this interpreter, and what to do instead."""
    if finder is not None:
        return None
    if not info["enabled"]:
        return "MCORE_AUTOPATCH=%s switches mcore-autopatch off; unset it (or set auto) to enable" % info["mode_env"]
    alternative = "import mcore_autopatch; mcore_autopatch.install() before megatron-core saves"
    if sys.flags.no_site:
        return "python -S: no .pth file is processed; call %s" % alternative
    if info["zip_archive"]:
        return "imported from the zip archive %s (a zipapp?), whose .pth files Python never processes; call %s" % (
            info["zip_archive"],
            alternative,
        )
    pth = info["startup_file"]
    if pth and not info["startup_file_processed"]:
        folder = os.path.dirname(pth)
        return (
            "installed in %s, a folder Python does not scan for .pth files (pip install --target, "
            "PYTHONPATH): call site.addsitedir(%r), or %s" % (folder, folder, alternative)
        )
    if pth is None:
        return "mcore_autopatch.pth is not in any site-packages folder; reinstall the wheel, or call %s" % alternative
    return "the startup hook did not run in this interpreter; call %s" % alternative


def check(info: Dict[str, Any]) -> Tuple[int, str]:
    """``mcore-autopatch check``: exit code and its one line."""
    if info["applied"]:
        return ACTIVE_OR_NOT_NEEDED, "ok: fix active (%s)" % info["reason"]
    if info["needed"] is False:
        return ACTIVE_OR_NOT_NEEDED, "ok: fix not needed (%s)" % info["reason"]
    if info["needed"] is True:
        detail = "%s (%s)" % (info["advice"], info["reason"]) if info["advice"] else info["reason"]
        return NEEDED_NOT_ACTIVE, "FAIL: fix needed but not active in this interpreter: %s" % detail
    return CANNOT_TELL, "UNKNOWN: cannot tell whether the fix is needed: %s" % info["reason"]
