"""``mcore-autopatch`` / ``python -m mcore_autopatch``: status, check, selftest.

* ``status [--json]``: a short report (or the ``status()`` dict as JSON).
* ``check``: exit 0 when the fix is active or not needed, 1 when it is needed but would
  not be active in this interpreter, 2 when it cannot tell; one line saying which.
* ``selftest [--dir DIR]``: real tiny async saves and loads (plain and
  distributed-optimizer-style state, two overlapping saves); exit 0 only when every round trip
  is equal, 1 when one fails, 2 when it cannot run here.
* ``inspect DIR [--json]``: what a torch_dist checkpoint holds (which torch wrote it,
  ``mcore_data``, N-D flattened tensors, whether its files match its ``.metadata``) and whether
  it loads in this environment; exit 1 when its files do not match (another save's write results).
* ``repair DIR [--dry-run]``: write a checkpoint's lost ``mcore_data`` back, only when every
  original shape is proved; exit 1 and change nothing otherwise, 2 for a folder that is not
  a readable checkpoint.

``status`` and ``check`` import each installed writer module (megatron-core's, and
nvidia-resiliency-ext's) to decide, the way a training job would, so they answer for this
interpreter as it was started. Results go to stdout; the ``mcore_autopatch`` logger
(``MCORE_AUTOPATCH_LOG``) writes only to stderr.
"""

import argparse
import json
from typing import Any, Dict, List, Optional

import mcore_autopatch


def _yes_no(value: Optional[bool]) -> str:
    return {True: "yes", False: "no", None: "cannot tell"}[value]


def _mode(info: Dict[str, Any]) -> str:
    if info["mode_env"] is None:
        mode = "auto (MCORE_AUTOPATCH unset)"
    else:
        mode = "%s (MCORE_AUTOPATCH=%s)" % (info["mode"], info["mode_env"])
    if not info["mode_recognised"]:
        mode += ", an unknown value: behaving as auto"
    return mode


def _startup_file(info: Dict[str, Any]) -> str:
    if info["zip_archive"]:
        return "none: imported from the zip archive %s (never processed)" % info["zip_archive"]
    if not info["startup_file"]:
        return "mcore_autopatch.pth not found"
    state = "processed at startup" if info["startup_file_processed"] else "NOT processed at startup"
    return "%s (%s)" % (info["startup_file"], state)


def _other_writer(writer: Dict[str, Any]) -> str:
    """One line for a known writer other than megatron-core's (nvidia-resiliency-ext)."""
    version = writer["version"] or "version unknown"
    if writer["version_source"]:
        version += " (version from %s)" % writer["version_source"]
    return "%s; fix needed: %s: %s; fix applied: %s" % (
        version,
        _yes_no(writer["needed"]),
        writer["reason"],
        _yes_no(writer["applied"]),
    )


def _fix_line(fix: Dict[str, Any]) -> str:
    """One line for a fix of the table other than the writer fix."""
    return "needed: %s, applied: %s: %s" % (_yes_no(fix["needed"]), _yes_no(fix["applied"]), fix["reason"])


def format_status(info: Dict[str, Any]) -> str:
    """The human report of ``status``: one labelled line per fact."""
    if info["hook_installed"]:
        hook = "installed by %s" % info["installed_by"]
    else:
        hook = "not installed in this interpreter"
    megatron = "not installed"
    if info["megatron_core"]:
        megatron = "%s (version from %s)" % (info["megatron_core"], info["megatron_core_source"])
    rows = [
        ("mode", _mode(info)),
        ("startup hook", hook),
        ("startup file", _startup_file(info)),
        ("python", "%s (%s)" % (info["python"], info["executable"])),
        ("torch", info["torch"] or "not installed"),
        ("megatron-core", megatron),
        ("fix needed", "%s: %s" % (_yes_no(info["needed"]), info["reason"])),
        ("fix applied", _yes_no(info["applied"])),
    ]
    installed = {w["name"] for w in info.get("writers", []) if w["installed"]}
    for fix in info.get("fixes", []):
        if fix["fix"] != "write_item" and fix["library"] in installed:
            rows.append((fix["fix"], _fix_line(fix)))
    for writer in info.get("writers", [])[1:]:  # megatron-core's is the rows above
        if writer["installed"]:
            rows.append((writer["name"], _other_writer(writer)))
    if info["advice"] and not info["applied"]:
        rows.append(("to activate", info["advice"]))
    lines = ["mcore-autopatch %s" % info["version"]]
    lines += ["  %-14s %s" % (label + ":", value) for label, value in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-autopatch",
        description=(
            "Fixes megatron-core's (and nvidia-resiliency-ext's) async checkpoint writer on torch 2.7+; "
            "reports whether it is active."
        ),
        epilog="Environment: MCORE_AUTOPATCH=auto|0|force, MCORE_AUTOPATCH_LOG=debug|info|warning|error (stderr).",
    )
    parser.add_argument("--version", action="version", version="mcore-autopatch %s" % mcore_autopatch.__version__)
    commands = parser.add_subparsers(dest="command", metavar="{status,check,selftest,inspect,repair}")
    status = commands.add_parser("status", help="versions, whether the fix is needed, installed and applied")
    status.add_argument("--json", action="store_true", help="print the mcore_autopatch.status() dict as JSON")
    commands.add_parser("check", help="exit 0: active or not needed; 1: needed but not active; 2: cannot tell")
    selftest = commands.add_parser("selftest", help="a real tiny async checkpoint save and load (gloo, one rank)")
    selftest.add_argument("--dir", help="make the temporary checkpoint folder inside DIR (default: the system's)")
    inspect = commands.add_parser(
        "inspect", help="which torch wrote a torch_dist checkpoint, whether mcore_data is there, whether it loads here"
    )
    inspect.add_argument("dir", metavar="DIR", help="the checkpoint folder (the one holding .metadata)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    repair = commands.add_parser(
        "repair", help="write a checkpoint's lost mcore_data back, only when every shape is proved"
    )
    repair.add_argument("dir", metavar="DIR", help="the checkpoint folder (the one holding .metadata)")
    repair.add_argument("--dry-run", action="store_true", help="say what would be written; write nothing")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    import sys

    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit: a reader that went away is handled below
        return code
    except BrokenPipeError:
        # The reader went away (``status --json | head -1``): stop quietly, as command-line
        # tools do, and keep Python from reporting the pipe again when it flushes at exit.
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


def _silence_stdout() -> None:
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _run(argv: Optional[List[str]]) -> int:
    args = _parser().parse_args(argv)
    command = args.command or "status"
    if command == "selftest":
        from mcore_autopatch.cli import selftest

        return selftest.run(folder=args.dir)
    if command in ("inspect", "repair"):
        return _checkpoint_command(command, args)
    from mcore_autopatch.cli import report

    with report.quiet_imports():
        info = report.status(import_writer=True)
    if command == "check":
        code, line = report.check(info)
        print(line)
        return code
    if getattr(args, "json", False):
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
    else:
        print(format_status(info))
    return 0


def _checkpoint_command(command: str, args: argparse.Namespace) -> int:
    import sys

    from mcore_autopatch.cli import inspect_checkpoint, report
    from mcore_autopatch.shared import checkpoint_metadata

    try:
        with report.quiet_imports():
            if command == "repair":
                code, lines = inspect_checkpoint.repair(args.dir, dry_run=args.dry_run)
                print("\n".join(lines))
                return code
            result = inspect_checkpoint.inspect(args.dir, inspect_checkpoint.guard_state())
    except checkpoint_metadata.CheckpointProblem as exc:
        print("mcore-autopatch %s: %s" % (command, exc), file=sys.stderr)
        return inspect_checkpoint.CANNOT_RUN
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        print(inspect_checkpoint.format_report(result))
    return inspect_checkpoint.exit_code(result)
