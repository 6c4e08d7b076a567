"""``mcore-autopatch`` / ``python -m mcore_autopatch``: status, check, selftest.

* ``status [--json]``: a short report (or the ``status()`` dict as JSON).
* ``check``: exit 0 when the fix is active or not needed, 1 when it is needed but would
  not be active in this interpreter, 2 when it cannot tell; one line saying which.
* ``selftest``: a real tiny async save and load; exit 0 only when the round trip is equal.

``status`` and ``check`` import megatron-core's writer module to decide.
"""

import argparse
import json
from typing import Any, Dict, List, Optional

import mcore_autopatch


def _yes_no(value: Optional[bool]) -> str:
    return {True: "yes", False: "no", None: "cannot tell"}[value]


def format_status(info: Dict[str, Any]) -> str:
    mode_env = info["mode_env"]
    mode = (
        "%s (MCORE_AUTOPATCH=%s)" % (info["mode"], mode_env) if mode_env is not None else "auto (MCORE_AUTOPATCH unset)"
    )
    if not info["mode_recognised"]:
        mode += ", unknown value: behaving as auto"
    if info["hook_installed"]:
        hook = "installed (by %s)" % info["activated_by"]
    else:
        hook = "not installed"
    startup = info["startup_file"] or "not found"
    if info["startup_file"]:
        startup += " (processed at startup)" if info["startup_file_processed"] else " (NOT processed at startup)"
    rows = [
        ("mode", mode),
        ("startup hook", hook),
        ("startup file", startup),
        ("python", "%s (%s)" % (info["python"], info["executable"])),
        ("torch", info["torch"] or "not installed"),
        (
            "megatron-core",
            "%s (from %s)" % (info["megatron_core"], info["megatron_core_source"])
            if info["megatron_core"]
            else "not installed",
        ),
        ("fix needed", "%s: %s" % (_yes_no(info["needed"]), info["reason"])),
        ("fix applied", _yes_no(info["applied"])),
    ]
    if info["advice"] and not info["applied"]:
        rows.append(("to activate", info["advice"]))
    lines = ["mcore-autopatch %s" % info["version"]]
    lines += ["  %-14s %s" % (label + ":", value) for label, value in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-autopatch",
        description="Fixes megatron-core's async checkpoint writer on torch 2.7+; reports whether it is active.",
    )
    parser.add_argument("--version", action="version", version="mcore-autopatch %s" % mcore_autopatch.__version__)
    commands = parser.add_subparsers(dest="command")
    status = commands.add_parser("status", help="report versions, whether the fix is needed and applied")
    status.add_argument("--json", action="store_true", help="print the status() dict as JSON")
    commands.add_parser("check", help="exit 0 if active or not needed, 1 if needed but not active, 2 if unknown")
    commands.add_parser("selftest", help="a real tiny async checkpoint save and load")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command or "status"
    if command == "selftest":
        from mcore_autopatch import selftest

        return selftest.run()
    from mcore_autopatch import report

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
