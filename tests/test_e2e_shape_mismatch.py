"""A resume into another padded vocabulary (allow_shape_mismatch_on_load), for real.

tests/job_path/training_job.py ``--padded-vocab N``: the word embeddings and an output layer
have N rows, sharded over 2 gloo ranks along the vocabulary as tensor parallelism shards
them, and saved with ``allow_shape_mismatch=True`` as megatron-core saves them (Megatron-LM
pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``, so another TP size
asks for another shape). The resume asks for another N (``--saved-vocab`` tells the job what
was saved): every value must be the saved overlap, zeros elsewhere. On torch 2.6+ megatron-core
0.6 - 0.11 fail it with torch's ``Size mismatch between saved ... and current``; 0.12 passes
it itself. A tensor saved without ``allow_shape_mismatch`` (``--rigid-vocab``) of another
shape must still fail. The jobs never import mcore_autopatch.
"""

import json
from typing import Any, Dict, List

import pytest
from conftest import (
    CPU_TORCH,
    clean_env,
    compat_params,
    fresh_key,
    job_failure,
    mcore_folder,
    run_dir_folder,
    run_python,
    run_training_job,
)

pytestmark = pytest.mark.e2e

EVERYDAY = fresh_key(CPU_TORCH, "numpy2")
SAVED_VOCAB = 8
SIZE_MISMATCH = "Size mismatch between saved torch.Size([8, 6]) and current: torch.Size([12, 6])"
RIGID = "Global shape mismatch for loaded (torch.Size([8, 6])) and expected ((12, 6))"
AFFECTED = ["0.6.0", "0.7.0", "0.8.0", "0.9.0", "0.10.0", "0.11.0"]
# 0.7's fully parallel load all-gathers uneven pieces, which gloo refuses (training_job.py).
RELEASE_ARGS: Dict[str, List[str]] = {"0.7.0": ["--plain-load"]}
RESHARD = "resume into another padded vocabulary: saved overlap, zeros elsewhere"


def args_of(version: str, *extra: str) -> List[str]:
    return ["--state", "model", *RELEASE_ARGS.get(version, []), *extra]


def saved(python: str, version: str, *extra: str) -> str:
    root = run_dir_folder("vocab-%s-" % version)
    save = run_training_job(
        python, version, "save", root, "--iterations", "1", *args_of(version, "--padded-vocab", "8", *extra)
    )
    assert save["ok"], job_failure(save)
    return root


def resumed(python: str, version: str, root: str, vocab: int, *extra: str, env: Any = None) -> Dict[str, Any]:
    args = args_of(version, "--padded-vocab", str(vocab), "--saved-vocab", str(SAVED_VOCAB), *extra)
    return run_training_job(python, version, "resume", root, *args, env=env)


def assert_loaded_equal(result: Dict[str, Any]) -> None:
    assert result["ok"], job_failure(result)
    assert all(r["loaded_equal"] and r["mismatched"] == [] for r in result["ranks"])


def error_text(result: Dict[str, Any]) -> str:
    return "\n".join((r.get("error") or "") + (r.get("traceback") or "") for r in result["ranks"])


@pytest.mark.parametrize("version", compat_params(["0.11.0"], RESHARD))
def test_padded_vocabulary_grows_and_shrinks_on_resume_with_the_wheel(torch_python, version):
    python = torch_python(EVERYDAY)
    root = saved(python, version)
    for vocab in (12, 6):  # another TP size: 8 rows padded for TP 2, 12 for TP 4 or 6 for TP 1 ...
        assert_loaded_equal(resumed(python, version, root, vocab))


def test_without_the_fix_the_resume_fails_on_torchs_size_check_and_a_rigid_tensor_still_fails(torch_python):
    python = torch_python(EVERYDAY)
    root = saved(python, "0.11.0")
    off = resumed(python, "0.11.0", root, 12, env={"MCORE_AUTOPATCH_SKIP": "allow_shape_mismatch_on_load"})
    assert not off["ok"] and SIZE_MISMATCH in error_text(off), job_failure(off)
    rigid_root = saved(python, "0.11.0", "--rigid-vocab")
    rigid = resumed(python, "0.11.0", rigid_root, 12, "--rigid-vocab")
    assert not rigid["ok"] and RIGID in error_text(rigid), job_failure(rigid)


def test_0_12_passes_it_itself_and_is_left_alone(torch_python):
    python = torch_python(EVERYDAY)
    assert_loaded_equal(resumed(python, "0.12.1", saved(python, "0.12.1"), 12))
    status = run_python(
        python, ["-m", "mcore_autopatch", "status", "--json"], clean_env(PYTHONPATH=mcore_folder("0.12.1"))
    )
    row = next(f for f in json.loads(status.stdout)["fixes"] if f["fix"] == "allow_shape_mismatch_on_load")
    assert (row["needed"], row["applied"]) == (False, False), row
    assert "lets tensors saved with allow_shape_mismatch past torch's size check itself" in row["reason"]


# --- the matrix: 0.6.0 - 0.11.0 on torch 2.6.0 (the first with the check) and the newest ----------------
# (and 0.11.0 on torch 2.9.0, where the mcore_data fixes take part in the same load: the
# padded tensors are not flattened ones, so the other releases add nothing there).

TORCHES = ["2.6.0", fresh_key("2.15.0", "numpy2")]
WITH_MCORE_DATA_FIXES = ("0.11.0", fresh_key("2.9.0", "numpy2"))


@pytest.mark.parametrize(
    "version,torch_release",
    [
        pytest.param(v, t, marks=[pytest.mark.compat(v, RESHARD), pytest.mark.matrix], id="%s-%s" % (v, t))
        for v, t in [*((v, t) for v in AFFECTED for t in TORCHES), WITH_MCORE_DATA_FIXES]
    ],
)
def test_every_affected_release_resumes_into_another_padded_vocabulary(torch_python, version, torch_release):
    python = torch_python(torch_release)
    root = saved(python, version)
    assert_loaded_equal(resumed(python, version, root, 12))
    if torch_release == TORCHES[-1]:
        off = resumed(python, version, root, 12, env={"MCORE_AUTOPATCH_SKIP": "allow_shape_mismatch_on_load"})
        assert not off["ok"] and SIZE_MISMATCH in error_text(off), job_failure(off)
