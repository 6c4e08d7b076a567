"""``mcore-autopatch inspect DIR`` and ``repair DIR``: what a torch_dist checkpoint holds.

``inspect`` reads ``DIR/.metadata`` (torch must be importable) and says which torch wrote it,
whether megatron-core's ``mcore_data`` is there, which tensors are N-D flattened (with their
original shapes, and how each is known), whether every file ends where its last item ends
(a checkpoint finalized with another save's write results does not: ``shared/storage_layout.py``),
and whether it will load in this environment. It exits 1 for such a damaged checkpoint, and for
a folder with ``.distcp`` files and no ``.metadata`` (an unfinished save: it says which
iteration beside it to resume from instead).

``repair`` writes the ``mcore_data`` a checkpoint lost back into its ``.metadata``, only when
every N-D flattened tensor's original shape is proved (``checkpoint_metadata``); the file is
torch's own ``Metadata`` pickled as torch pickles it, readable without mcore-autopatch. The
old file is kept beside it; nothing is written when anything is not proved.
"""

import json
import os
import pickle
import shutil
import sys
from typing import Any, Dict, List, Optional, Tuple

from mcore_autopatch.shared import checkpoint_metadata as cm
from mcore_autopatch.shared import storage_layout

BACKUP_SUFFIX = ".before-mcore-autopatch-repair"
OK, NOT_PROVABLE, CANNOT_RUN = 0, 1, 2
DAMAGED = 1  # inspect's exit code for a checkpoint whose files do not match its .metadata
WAY_OUT = "resume from another iteration"


def written_by(metadata: Any) -> str:
    """Which torch releases write a Metadata like this one (from the fields torch adds)."""
    version = vars(metadata).get("version")
    if version is not None:
        return "torch 2.9 or later (DCP format version %s)" % version
    storage_meta = vars(metadata).get("storage_meta")
    if storage_meta is not None and "modules" in vars(storage_meta):
        return "torch 2.7 or 2.8 (no DCP format version)"
    return "torch 2.6 or earlier (no DCP format version)"


def megatron_files(folder: str) -> Dict[str, Any]:
    try:
        with open(os.path.join(folder, "metadata.json")) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def storage_verdict(mismatched: List[str]) -> str:
    """One line on a checkpoint whose files do not match its .metadata."""
    return (
        "no: its .metadata does not match its files (%s%s): it was finalized with another save's write "
        "results (async saves that overlapped, a synchronous save made during an async one, or a save after "
        "an abandoned one, without mcore-autopatch's write_results_per_save); %s"
        % (
            "; ".join(mismatched[:2]),
            "; and %d more files" % (len(mismatched) - 2) if len(mismatched) > 2 else "",
            WAY_OUT,
        )
    )


def load_verdict(report: Dict[str, Any], guard: Optional[Dict[str, Any]]) -> str:
    """Whether a resume of this checkpoint works in this interpreter, and why."""
    if report["storage"]["mismatched"]:
        return storage_verdict(report["storage"]["mismatched"])
    flattened = [t for t in report["tensors"] if t["kind"] != "regular"]
    if report["mcore_data"]:
        return "yes: mcore_data is there"
    if not flattened:
        return "yes: no N-D flattened tensor needs mcore_data"
    unknown = [t for t in flattened if t["kind"] == "unknown"]
    if guard is None:
        return "cannot tell: megatron-core is not importable here"
    if guard["needed"] is False:
        return "cannot tell: %s" % guard["reason"]
    if not guard["applied"]:
        return "no: a resume stops with AttributeError: 'Metadata' object has no attribute 'mcore_data' (%s)" % (
            "mcore-autopatch's load guard is not active in this interpreter"
        )
    if unknown:
        return (
            "only with the tensor- and pipeline-parallel sizes of the save (any data-parallel size): %d tensor(s) "
            "have no provable original shape, and another layout stops with a clear error" % len(unknown)
        )
    return "yes: mcore-autopatch's load guard recovers the original shapes (each proved below)"


TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's, beside the iter_* folders


def unfinished_save(folder: str) -> Optional[Dict[str, Any]]:
    """The report on a folder with ``.distcp`` files and no ``.metadata``: a save that failed or
    was stopped before its finalize (only ``.metadata`` marks a finished one), or None."""
    if not os.path.isdir(folder) or os.path.exists(os.path.join(folder, cm.METADATA_FILE)):
        return None
    written = sorted(name for name in os.listdir(folder) if name.endswith(".distcp"))
    if not written:
        return None
    resume_from = last_finished_save(os.path.dirname(os.path.abspath(folder)), exclude=os.path.abspath(folder))
    way_out = "resume from %s" % resume_from if resume_from else "no finished save beside it to resume from"
    return {
        "checkpoint": os.path.abspath(folder),
        "unfinished": True,
        "distcp_files": len(written),
        "resume_from": resume_from,
        "loads_here": "no: an unfinished save (%d .distcp files, no .metadata): it failed or was stopped before "
        "its finalize wrote .metadata, which alone marks a finished save; %s" % (len(written), way_out),
    }


def last_finished_save(root: str, exclude: str = "") -> Optional[str]:
    """The iteration folder to resume from: the tracker's when it is finished, else the newest
    ``iter_*`` folder beside it that has a ``.metadata``."""
    finished = [
        os.path.join(root, name)
        for name in os.listdir(root)
        if name.startswith("iter_") and os.path.isfile(os.path.join(root, name, cm.METADATA_FILE))
    ]
    finished = [f for f in finished if f != exclude]
    try:
        with open(os.path.join(root, TRACKER)) as f:
            tracked = os.path.join(root, "iter_%07d" % int(f.read().strip()))
        if tracked in finished:
            return tracked
    except (OSError, ValueError):
        pass
    return max(finished) if finished else None


def inspect(folder: str, guard: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    unfinished = unfinished_save(folder)
    if unfinished is not None:
        return unfinished
    metadata = cm.read_metadata(folder)
    tensors = cm.classify(metadata)
    ends = storage_layout.ends_by_file((getattr(metadata, "storage_data", None) or {}).values())
    mismatched, unseen = storage_layout.compare_with_files(folder, ends)
    report: Dict[str, Any] = {
        "checkpoint": os.path.abspath(folder),
        "written_by": written_by(metadata),
        "dcp_version": vars(metadata).get("version"),
        "megatron_metadata_json": megatron_files(folder),
        "mcore_data": cm.has_mcore_data(metadata),
        "all_local_plans": vars(metadata).get("all_local_plans") is not None,
        "storage": {"files": len(ends), "mismatched": [m.text for m in mismatched], "missing": unseen},
        "tensors": [
            {
                "key": t.key,
                "saved_shape": list(t.saved_shape),
                "kind": t.kind,
                "original_shape": list(t.shape) if t.shape else None,
                "evidence": t.evidence,
            }
            for t in tensors
        ],
    }
    report["n_d_flattened"] = [t["key"] for t in report["tensors"] if t["kind"] == "flattened"]
    report["unprovable"] = [t["key"] for t in report["tensors"] if t["kind"] == "unknown"]
    report["loads_here"] = load_verdict(report, guard)
    report["repairable"] = (not report["mcore_data"]) and bool(report["n_d_flattened"]) and not report["unprovable"]
    return report


def format_report(report: Dict[str, Any]) -> str:
    lines = ["checkpoint %s" % report["checkpoint"]]
    if report.get("unfinished"):
        return "\n".join([*lines, "  %-16s %s" % ("loads here:", report["loads_here"])])
    rows = [
        ("written by", report["written_by"]),
        ("mcore_data", "present" if report["mcore_data"] else "MISSING"),
        ("all_local_plans", "present" if report["all_local_plans"] else "missing"),
        (
            "tensors",
            "%d (%d N-D flattened, %d look flattened without a provable shape)"
            % (len(report["tensors"]), len(report["n_d_flattened"]), len(report["unprovable"])),
        ),
        ("files", _files_text(report["storage"])),
        ("loads here", report["loads_here"]),
    ]
    lines += ["  %-16s %s" % (label + ":", value) for label, value in rows]
    for t in report["tensors"]:
        if t["kind"] == "regular":
            continue
        shape = cm.shape_text(t["original_shape"]) if t["original_shape"] else "unknown"
        lines.append(
            "  %s %s: saved as %s, original shape %s (%s)"
            % (
                "N-D flattened" if t["kind"] == "flattened" else "looks flattened",
                t["key"],
                cm.shape_text(t["saved_shape"]),
                shape,
                t["evidence"],
            )
        )
    if report["repairable"]:
        lines.append(
            "  every original shape is proved: `mcore-autopatch repair %s` writes mcore_data back"
            % report["checkpoint"]
        )
    return "\n".join(lines)


def _files_text(storage: Dict[str, Any]) -> str:
    if storage["mismatched"]:
        return "%d, %d NOT matching .metadata" % (storage["files"], len(storage["mismatched"]))
    if storage["missing"]:
        return "%d, %d missing: %s" % (storage["files"], len(storage["missing"]), ", ".join(storage["missing"][:3]))
    return "%d, each ends where its last item ends" % storage["files"]


def exit_code(report: Dict[str, Any]) -> int:
    """inspect's exit status: 1 for a checkpoint whose files do not match its .metadata."""
    return DAMAGED if report.get("unfinished") or report["storage"]["mismatched"] else OK


def repair(folder: str, dry_run: bool = False) -> Tuple[int, List[str]]:
    """Write the proved ``mcore_data`` into ``folder/.metadata``; (exit code, lines to print)."""
    metadata = cm.read_metadata(folder)
    path = os.path.join(folder, cm.METADATA_FILE)
    if cm.has_mcore_data(metadata):
        return OK, ["%s already has mcore_data: nothing to repair" % path]
    tensors = cm.classify(metadata)
    unknown = [t.key for t in tensors if t.kind == "unknown"]
    if unknown:
        return NOT_PROVABLE, [
            "not repaired: the original shapes of %d tensor(s) cannot be proved from the checkpoint (%s); "
            "%s is unchanged" % (len(unknown), ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else ""), path)
        ]
    mcore_data = cm.recovered_mcore_data(tensors) or {}
    flattened = [t for t in tensors if t.kind == "flattened"]
    lines = ["%s: mcore_data for %d tensors, %d of them N-D flattened:" % (path, len(mcore_data), len(flattened))]
    lines += ["  %s: %s (%s)" % (t.key, cm.shape_text(t.shape or ()), t.evidence) for t in flattened]
    if dry_run:
        return OK, [*lines, "dry run: nothing written"]
    metadata.mcore_data = mcore_data
    backup = path + BACKUP_SUFFIX
    temporary = path + ".mcore-autopatch-tmp"
    with open(temporary, "wb") as f:
        pickle.dump(metadata, f)  # as torch's FileSystemWriter.finish pickles it
        f.flush()
        os.fsync(f.fileno())
    if not os.path.exists(backup):
        shutil.copy2(path, backup)
    os.replace(temporary, path)
    check = cm.read_metadata(folder)
    if getattr(check, "mcore_data", None) != mcore_data:
        return NOT_PROVABLE, [
            *lines,
            "the rewritten %s does not read back as written; the old one is %s" % (path, backup),
        ]
    return OK, [*lines, "written; the previous file is kept as %s" % backup]


def guard_state() -> Optional[Dict[str, Any]]:
    """The load guard's row of ``status`` in this interpreter (importing megatron-core's
    strategies the normal way, so an active hook applies it), or None without megatron."""
    from mcore_autopatch import fixes
    from mcore_autopatch.cli import report

    try:
        __import__(fixes.STRATEGIES_TORCH)
    except Exception:
        return None
    fix = fixes.by_name("load_without_mcore_data")
    module = sys.modules.get(fix.watches[0])
    return report.fix_status(fix, module is not None, "auto")
