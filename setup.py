"""Carry mcore_autopatch.pth and mcore_autopatch.start at the root of the wheel, reproducibly.

setup.cfg holds the metadata. The first two commands exist because a .pth file must sit
at the top of site-packages, outside any package, which setup.cfg cannot express:

* build_py copies both files to the root of build_lib, so bdist_wheel packs them at the
  wheel root, pip records them, and ``pip uninstall`` removes them.
* editable_wheel (``pip install -e .``) adds them to the editable wheel as well.

bdist_wheel makes the wheel reproducible: the same sources give the same bytes, whatever
the checkout's file times and umask. Every member gets the time SOURCE_DATE_EPOCH names
or, when it is unset, a fixed one (1980-01-01, the earliest a zip can hold), and mode
0644 (0755 if executable). The sdist carries the startup files (MANIFEST.in), so a wheel
built from it equals the one built from the checkout.
"""

import os
import stat

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP_FILES = ("mcore_autopatch.pth", "mcore_autopatch.start")


class build_py_with_startup_files(build_py):
    def run(self):
        super().run()
        for name in STARTUP_FILES:
            self.copy_file(os.path.join(HERE, name), os.path.join(self.build_lib, name), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, n) for n in STARTUP_FILES]


try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1: the command comes from the wheel package
    from wheel.bdist_wheel import bdist_wheel

# Used when SOURCE_DATE_EPOCH is unset: 1980-01-01T00:00:00Z, the zip format's first day.
DEFAULT_SOURCE_DATE_EPOCH = "315532800"


class reproducible_bdist_wheel(bdist_wheel):
    def run(self):
        # The archive writer reads SOURCE_DATE_EPOCH for every member's time; set it only
        # while the wheel is built, so nothing else in this process sees it.
        unset = "SOURCE_DATE_EPOCH" not in os.environ
        if unset:
            os.environ["SOURCE_DATE_EPOCH"] = DEFAULT_SOURCE_DATE_EPOCH
        try:
            super().run()
        finally:
            if unset:
                os.environ.pop("SOURCE_DATE_EPOCH", None)

    def write_wheelfile(self, wheelfile_base, *args, **kwargs):
        # The last step before the archive is written: every file of the wheel is in
        # bdist_dir now, with modes that depend on the umask of the checkout and the build.
        super().write_wheelfile(wheelfile_base, *args, **kwargs)
        for folder, _dirs, files in os.walk(self.bdist_dir):
            for name in files:
                path = os.path.join(folder, name)
                executable = os.stat(path).st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
                os.chmod(path, 0o755 if executable else 0o644)


cmdclass = {"build_py": build_py_with_startup_files, "bdist_wheel": reproducible_bdist_wheel}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs to extend
    editable_wheel = None

if editable_wheel is not None and hasattr(editable_wheel, "_run_build_commands"):

    class editable_wheel_with_startup_files(editable_wheel):
        # _run_build_commands fills the folder whose files become the editable wheel's
        # root; the startup files go there, next to setuptools' own __editable__ files.
        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            for name in STARTUP_FILES:
                self.copy_file(os.path.join(HERE, name), os.path.join(unpacked_wheel, name), preserve_mode=False)
            return result

    cmdclass["editable_wheel"] = editable_wheel_with_startup_files

setup(cmdclass=cmdclass)
