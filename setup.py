"""Carry mcore_autopatch.pth and mcore_autopatch.start at the root of the wheel.

setup.cfg holds the metadata. These commands exist only because a .pth file must sit at
the top of site-packages, outside any package, which setup.cfg cannot express:

* build_py copies both files to the root of build_lib, so bdist_wheel packs them at the
  wheel root, pip records them, and ``pip uninstall`` removes them.
* editable_wheel (``pip install -e .``) adds them to the editable wheel as well.
"""

import os

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


cmdclass = {"build_py": build_py_with_startup_files}

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
