"""``status()``: what mcore-autopatch sees and decided in this interpreter, and ``check``.

Read-only: it never applies the fix itself. With ``import_writer`` it imports each known
writer module (``mcore_autopatch.shared.writers``) that is installed, the normal way, so an active
hook fires exactly as it would in a training job, and the answer reflects this interpreter
as it was started. megatron-core's answer is also given at the top level of the dict, under
the keys scripts have read since 0.1.0.
"""

import contextlib
import importlib
import os
import site
import sys
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import mcore_autopatch
from mcore_autopatch import fixes
from mcore_autopatch.shared import versions
from mcore_autopatch.shared.writers import KNOWN_WRITERS, KnownWriter

WRITE_ITEM_FIX = {f.watches[0]: f for f in fixes.FIXES if f.name == "write_item"}

STARTUP_FILES = ("mcore_autopatch.pth", "mcore_autopatch.start")
# status imports the checkpointing modules the fixes watch (a save imports them too); the
# model-code modules some fixes watch are judged from their code instead.
CHECKPOINTING = ("megatron.core.dist_checkpointing.", "nvidia_resiliency_ext.checkpointing.")

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
        return str(versions._metadata_module().version(name))
    except Exception:
        return None


def torch_version() -> Optional[str]:
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "")) or None
    return _dist_version("torch")


def _import_writer(module: str) -> Tuple[Optional[Any], Optional[str], Optional[str]]:
    """(module, problem, name of the missing module) after trying to import a writer module."""
    try:
        return importlib.import_module(module), None, None
    except ModuleNotFoundError as exc:
        return None, "%s: %s" % (type(exc).__name__, exc), exc.name or ""
    except Exception as exc:
        return None, "%s: %s" % (type(exc).__name__, exc), None


def _is_part_of(missing: Optional[str], module: str) -> bool:
    """Whether the missing module ``missing`` is ``module`` or one of its packages."""
    return bool(missing) and (module == missing or module.startswith(str(missing) + "."))


def writer_status(known: KnownWriter, import_writer: bool, mode: str) -> Dict[str, Any]:
    """What is known and decided about one known writer in this interpreter."""
    version = versions.writer_version(known)
    row: Dict[str, Any] = {
        "name": known.name,
        "module": known.module,
        "version": version.version,
        "version_source": version.source if version.version else None,
        "installed": version.version is not None,
        "imported": known.module in sys.modules,
        "writer_code": None,
        "torch_write_item": None,
        "needed": None,
        "applied": False,
        "reason": "",
        "missing": None,
        "hook_decision": None,
    }
    writer = sys.modules.get(known.module)
    problem = None
    if writer is None and import_writer:
        writer, problem, row["missing"] = _import_writer(known.module)
    if writer is None:
        top = known.module.split(".")[0]
        if problem is None:
            row["reason"] = "%s's writer module is not imported in this process (yet)" % known.name
        elif row["missing"] == top or (_is_part_of(row["missing"], known.module) and not row["installed"]):
            row.update(installed=False, needed=False)
            row["reason"] = "%s is not installed in this interpreter: nothing to fix" % known.name
        elif _is_part_of(row["missing"], known.module):
            row.update(installed=True, needed=False)
            row["reason"] = "%s %s has no %s: nothing to fix" % (known.name, version.version, known.module)
        elif (row["missing"] or "").split(".")[0] == "torch":
            row["installed"] = True
            row["reason"] = (
                "torch is not importable in this interpreter (%s), so neither its _write_item nor "
                "%s's writer can be read" % (problem, known.name)
            )
        else:
            row["installed"] = True
            row["reason"] = "cannot import %s's writer module: %s" % (known.name, problem)
        return row

    from mcore_autopatch.fixes import write_item

    ev = write_item.evaluate(writer, "auto" if mode == "off" else mode)
    current = vars(writer).get("_write_item")
    row.update(installed=True, imported=True)
    row["writer_code"] = ev.call.text if ev.call else None
    row["torch_write_item"] = ev.signature.text if ev.signature else None
    row["needed"] = ev.decision.needed
    row["applied"] = write_item.is_safe_write_item(current)
    reason = ev.decision.reason
    if ev.decision.needed and not row["applied"] and ev.original is not None and current is not ev.original:
        reason += "; %s._write_item has been replaced by %s" % (writer.__name__, _name(current))
    row["reason"] = reason
    row["hook_decision"] = fixes.last_decision(WRITE_ITEM_FIX[known.module])  # what the hook decided at import
    return row


def fix_status(fix: fixes.Fix, installed: bool, mode: str, decided: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One fix of the table: what it reads and rebinds, whether it is needed and applied, over
    its watched modules that are imported here (or readable without importing them).
    ``decided``: needed / applied / reason / hook_decision already worked out (the writer
    fix's, from ``writer_status``), so that nothing is read twice."""
    row: Dict[str, Any] = {
        "fix": fix.name,
        "library": fix.library,
        "module": fix.watches[0],
        "modules": list(fix.watches),
        "reads": fix.reads,
        "rebinds": fix.rebinds,
        "needed": None,
        "applied": False,
        "reason": "",
        "skipped": fixes.is_skipped(fix),
        "hook_decision": fixes.last_decision(fix),
    }
    if decided is not None:
        row.update(decided)
        return row
    answers = module_answers(fix, mode)
    if answers:
        row.update(fixes.combine(answers) or {})
    elif installed:
        row["reason"] = "%s is not imported in this process (yet)" % " / ".join(fix.watches)
    else:
        row.update(needed=False, reason="%s is not installed in this interpreter: nothing to fix" % fix.library)
    if row["skipped"] and row["needed"] is not False:
        row["reason"] += "; skipped: %s names it" % fixes.SKIP_ENV
    return row


def module_answers(fix: fixes.Fix, mode: str) -> List[Dict[str, Any]]:
    """needed / applied / reason for each watched module of ``fix`` that can be judged here:
    the imported ones, and (for a fix that acts while a body runs) the ones whose code can
    be read without importing them; those are applied when the hook is active for them."""
    implementation = fix.implemented_by()
    judge_mode = "auto" if mode == "off" else mode
    active = mode != "off" and mcore_autopatch.installed_finder() is not None and not fixes.is_skipped(fix)
    answers = []
    for name in fix.watches:
        module = sys.modules.get(name)
        if module is not None:
            decision = implementation.evaluate(module, judge_mode).decision
            applied = implementation.is_applied(module)
        elif hasattr(implementation, "evaluate_unimported"):
            ev = implementation.evaluate_unimported(name, judge_mode)
            if ev is None:
                continue  # not in this release
            decision, applied = ev.decision, bool(ev.decision.needed) and active
        else:
            continue
        answers.append(
            {"needed": decision.needed, "applied": applied, "reason": decision.reason, "where": decision.where}
        )
    return answers


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
    }
    rows = [writer_status(known, import_writer, mode) for known in KNOWN_WRITERS]
    by_library = {row["name"]: row for row in rows}
    for fix in fixes.FIXES:
        writer_row = by_library.get(fix.library)
        if import_writer and writer_row and writer_row["imported"]:
            for name in fix.watches:
                if name not in sys.modules and name.startswith(CHECKPOINTING):
                    _import_writer(name)  # e.g. megatron-core's strategies.torch, as a save imports it
    fix_rows = []
    for fix in fixes.FIXES:
        writer_row = by_library.get(fix.library) or {}
        decided = None
        if fix.name == "write_item" and writer_row:
            decided = {k: writer_row[k] for k in ("needed", "applied", "reason", "hook_decision")}
        fix_rows.append(fix_status(fix, bool(writer_row.get("installed")), mode, decided))
    info["torch"] = torch_version()
    megatron = rows[0]
    # megatron-core's row, also at the top level under the names scripts already read.
    info.update(
        megatron_core=megatron["version"],
        megatron_core_source=megatron["version_source"],
        writer_imported=megatron["imported"],
        torch_write_item=megatron["torch_write_item"],
        needed=megatron["needed"],
        applied=megatron["applied"],
        reason=megatron["reason"],
        missing=(megatron["missing"] or "").split(".")[0] or None,
        hook_decision=megatron["hook_decision"],
    )
    info["advice"] = _advice(info, finder)
    info["writers"] = rows
    info["fixes"] = fix_rows
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


def relevant_writers(info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The writers ``check`` answers for: megatron-core's always (installed or not), and each
    other writer that imported here. One that cannot be imported cannot save either."""
    rows = info.get("writers") or []
    return rows[:1] + [row for row in rows[1:] if row["imported"]]


def check(info: Dict[str, Any]) -> Tuple[int, str]:
    """``mcore-autopatch check``: exit code and its one line, over every fix of every library
    that is installed (megatron-core's writer fix is always answered for)."""
    relevant = relevant_writers(info)
    libraries = {row["name"] for row in relevant}
    rows = [row for row in info.get("fixes") or [] if row["library"] in libraries]
    rows = [row for row in rows if row["fix"] == "write_item" or row["needed"] is not False or row["applied"]]
    # Left out on purpose (MCORE_AUTOPATCH_SKIP): said, never a failure of the gate.
    failing = [row for row in rows if row["needed"] is True and not row["applied"] and not row.get("skipped")]
    if failing:
        reasons = "; ".join("%s: %s" % (_label(row), row["reason"]) for row in failing)
        detail = "%s (%s)" % (info["advice"], reasons) if info["advice"] else reasons
        return NEEDED_NOT_ACTIVE, "FAIL: fix needed but not active in this interpreter: %s" % detail
    unknown = [row for row in rows if row["needed"] is None and not row["applied"] and not row.get("skipped")]
    if unknown:
        return CANNOT_TELL, "UNKNOWN: cannot tell whether the fix is needed: %s" % "; ".join(
            "%s: %s" % (_label(row), row["reason"]) for row in unknown
        )

    def state(row: Dict[str, Any]) -> str:
        if row["applied"]:
            return "active"
        return "skipped" if row.get("skipped") and row["needed"] else "not needed"

    parts = ["%s %s (%s)" % (_label(row), state(row), row["reason"]) for row in rows]
    return ACTIVE_OR_NOT_NEEDED, "ok: " + "; ".join(parts)


def _label(row: Dict[str, Any]) -> str:
    """``fix`` for megatron-core's writer fix (the words check has always printed), else its name."""
    if row["fix"] == "write_item" and row["library"] == "megatron-core":
        return "fix"
    return "%s %s" % (row["library"], row["fix"]) if row["fix"] != "write_item" else "%s fix" % row["library"]
