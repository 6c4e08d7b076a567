"""`make gpu-check` (tools/gpu_check.sh) is ready for a machine with a GPU.

No GPU is lent to this project's CI, so here it is checked for what a CPU-only machine can
tell: the script parses, refuses to run without what `make gpu-check-prepare` puts in
.gpu-check/, and refuses a python without a CUDA device, saying so, with exit status 2.
"""

import os
import subprocess

import pytest
from conftest import ROOT, clean_env, envs

SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


@pytest.mark.e2e
def test_gpu_check_refuses_a_machine_without_cuda(tmp_path):
    python = envs.venv_python(envs.E2E)
    if not os.path.exists(python):
        pytest.skip("test environments missing: run `make test-env`")
    copy = tmp_path / "checkout"
    (copy / "tools").mkdir(parents=True)
    (copy / ".gpu-check").mkdir()
    with open(SCRIPT) as f:
        (copy / "tools" / "gpu_check.sh").write_text(f.read())
    env = clean_env(GPU_CHECK_PYTHON=python, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(copy / "tools" / "gpu_check.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr
