"""The package's rooms, as a newcomer reads them: the startup module, the import hook, the
table of fixes with one file per fix named as ``status`` names it, what the fixes share, and
the command line."""

import importlib.util
import os

from conftest import ROOT

from mcore_autopatch import fixes

PACKAGE = os.path.join(ROOT, "mcore_autopatch")


def python_files(folder: str) -> "set[str]":
    return {name[: -len(".py")] for name in os.listdir(folder) if name.endswith(".py")}


def test_every_fix_status_names_is_the_file_of_that_name_in_fixes():
    for fix in fixes.FIXES:
        expected = os.path.join(PACKAGE, "fixes", fix.name + ".py")
        assert fix.implementation == "mcore_autopatch.fixes." + fix.name
        spec = importlib.util.find_spec(fix.implementation)
        assert spec is not None and os.path.samefile(spec.origin, expected), fix.name


def test_every_file_in_fixes_is_a_row_of_the_table():
    assert python_files(os.path.join(PACKAGE, "fixes")) - {"__init__"} == {fix.name for fix in fixes.FIXES}


def test_the_rooms_of_the_package():
    top = {name for name in os.listdir(PACKAGE) if not name.startswith((".", "__pycache__"))}
    assert top == {"__init__.py", "__main__.py", "importhook.py", "py.typed", "fixes", "shared", "cli"}
    # The command line is together; what the fixes share is beside them.
    assert python_files(os.path.join(PACKAGE, "cli")) == {
        "__init__",
        "commands",
        "report",
        "selftest",
        "inspect_checkpoint",
    }
    assert "__init__" in python_files(os.path.join(PACKAGE, "shared"))
