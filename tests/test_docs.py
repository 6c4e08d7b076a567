"""README.md, README.zh-CN.md and docs/*.md cannot drift from the code: every fenced block
is checked or run here.

* ``console`` blocks: each ``$ command`` runs for real, in order, in a venv of the page's own
  (a clone of the torch 2.13.0 venv, megatron-core 0.12.1 on PYTHONPATH) that starts
  without mcore-autopatch; the lines under it are the expected output (``…`` matches
  anything, a line of ``…`` alone any number of lines). ``pip install mcore-autopatch``
  installs the wheel built from this checkout (the registry name stands for it here);
  ``/ckpt/iter_0000100`` is a copy of a real checkpoint saved by megatron-core 0.13.1 on torch
  2.9.0 without mcore-autopatch, so it lacks ``mcore_data``; ``make X`` must be a Makefile
  target (``make test`` is this very run, ``make demo`` has its own test in
  tests/test_tools_output.py). ``make wheel`` and ``pip install`` of the checkout or of the
  wheel it built run for real, in a copy of the checkout: what a newcomer does before the
  first release.
* ``text`` blocks: a file of the repository (its content, or a listing of paths that exist),
  or an error text that the code and the end-to-end tests produce.
* ``dockerfile`` blocks: every instruction is one of examples/Dockerfile, whose steps
  tests/test_cli.py runs.

The Chinese quick start must name the same commands, environment variables and error texts
as the English pages.
"""

import glob
import os
import re
import shutil
import subprocess
from typing import Any, Dict, List, Tuple

import pytest
from conftest import ROOT, checkout_for_make, clean_env, envs, install_wheel, mcore_folder

PAGES = sorted(
    os.path.relpath(p, ROOT) for p in [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "README.zh-CN.md")]
) + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.M | re.S)
CHECKPOINT_PLACEHOLDER = "/ckpt/iter_0000100"
ELLIPSIS = "…"

# The error texts people search for (tests/test_e2e_save.py and test_e2e_job_path.py assert
# that real saves and loads produce them).
from test_e2e_async_faults import REASONS  # noqa: E402
from test_e2e_async_results import DAMAGED_READS  # noqa: E402
from test_e2e_fresh_stack import (  # noqa: E402
    NO_PKG_RESOURCES,
    OLDER_TORCH_READING_2_15,
    PLANNED_TWICE,
    PRODUCT,
    STRIDES,
    WEIGHTS_ONLY,
)
from test_e2e_job_path import MISSING_MCORE_DATA  # noqa: E402
from test_e2e_save import MISSING_FORMAT, MISSING_STORAGE_KEY, MISSING_TWO  # noqa: E402
from test_e2e_shape_mismatch import SIZE_MISMATCH  # noqa: E402

WRITER_KILLED = REASONS["writer-sigkill"].replace(" while writing", "")
NO_PACKAGING = "ImportError: cannot import name 'packaging' from 'pkg_resources'"  # test_e2e_fresh_stack asserts it
ERROR_TEXTS = [
    MISSING_FORMAT,
    MISSING_TWO,
    MISSING_STORAGE_KEY,
    MISSING_MCORE_DATA,
    PRODUCT.split(": ", 1)[1],
    WEIGHTS_ONLY,
    NO_PKG_RESOURCES.split(": ", 1)[1],
    PLANNED_TWICE,
    DAMAGED_READS[0],
    SIZE_MISMATCH.split(" torch.Size")[0],
    STRIDES.split(": ", 1)[1],
    OLDER_TORCH_READING_2_15,
]


def blocks(page: str) -> List[Tuple[str, str]]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return [(m.group(1), m.group(2)) for m in FENCE.finditer(f.read())]


def page_text(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def test_every_page_is_listed_and_readme_stays_short():
    assert "docs/troubleshooting.md" in PAGES and "README.zh-CN.md" in PAGES
    assert os.path.getsize(os.path.join(ROOT, "README.md")) < 8 * 1024
    readme = page_text("README.md")
    assert readme.count("README.zh-CN.md") >= 1 and readme.index("README.zh-CN.md") < 200  # linked at the top
    for page in PAGES:
        for lang, _ in blocks(page):
            assert lang in ("console", "text", "dockerfile"), "%s: a ```%s block has no checking rule" % (page, lang)


# --- expected output ---------------------------------------------------------------------------


def matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` has ``expected``'s lines in order (``…`` inside a line matches
    anything; a line of ``…`` alone lets any lines pass before the next one)."""
    lines = [ln for ln in actual.splitlines()]
    position, skipping = 0, False
    for want in expected.splitlines():
        if want.strip() == ELLIPSIS:
            skipping = True
            continue
        pattern = re.compile("^" + ".*".join(re.escape(part) for part in want.split(ELLIPSIS)) + "$")
        while position < len(lines) and not pattern.match(lines[position]):
            if not skipping:
                return False
            position += 1
        if position == len(lines):
            return False
        position += 1
        skipping = False
    return True


def test_matches_is_strict_where_the_page_is_literal():
    assert matches("a\n…\nc …", "a\nb\nc d")
    assert not matches("a\nc", "a\nb\nc")
    assert not matches("x …", "y z")


# --- text and dockerfile blocks ------------------------------------------------------------------


def listed_paths(block: str) -> List[str]:
    """The paths of a layout listing: a top-level entry, and entries indented by two spaces
    per level under a folder (``fixes/`` under ``mcore_autopatch/``); a line indented by more
    than its parent folder's level allows continues a description."""
    paths: List[str] = []
    folders: List[str] = []  # the open folder at each level
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        level = indent // 2
        if indent % 2 or level > len(folders) or (level and not folders[level - 1]):
            continue  # a description's continuation
        names = line.strip().split("  ")[0]
        for name in (n.strip() for n in names.split(",")):
            if level and not re.match(r"^[\w./]+$", name):
                continue
            parent = "".join(folders[:level])
            test_module = parent == "tests/" and "." not in name and not name.endswith("/")
            paths.append(parent + name + (".py" if test_module else ""))
            del folders[level:]
            folders.append(name if name.endswith("/") else "")
    return paths


def known_errors() -> List[str]:
    from mcore_autopatch.fixes import failed_saves_raise_everywhere, load_without_mcore_data

    return [
        "RuntimeError: Worker failure: " + MISSING_FORMAT,
        "RuntimeError: Worker failure: " + MISSING_TWO,
        "RuntimeError: Worker failure: " + MISSING_STORAGE_KEY,
        "RuntimeError: Incomplete worker results (expected 1, got 0. This probably indicates a worker failure.",
        "AttributeError: " + MISSING_MCORE_DATA,
        "CheckpointingException: %s. … tensor(s) are loaded here with another layout than they were saved with, "
        "and their original shapes cannot be proved from the checkpoint: …"
        % load_without_mcore_data.cause(CHECKPOINT_PLACEHOLDER),
        "FAIL: fix needed but not active in this interpreter: …",
        PRODUCT,
        "_pickle.UnpicklingError: Weights only load failed. … Unsupported global: GLOBAL argparse.Namespace was not an "
        "allowed global by default. …",
        NO_PKG_RESOURCES,
        NO_PACKAGING + " (…)",
        "AssertionError: " + PLANNED_TWICE,
        "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory",
        "_pickle.UnpicklingError: Weights only load failed. … Unsupported persistent id …",
        "ValueError: %s for embedding.word_embeddings.weight"
        % SIZE_MISMATCH.replace("([8, 6])", "([…])").replace("([12, 6])", "([…])"),
        STRIDES,
        # tests/test_e2e_async_faults.py: every rank raises this, naming rank 1 and the killed writer
        "CheckpointException ranks:dict_keys([1])\nTraceback (most recent call last): (RANK 1)\nRuntimeError: rank 1: "
        "its write failed: RuntimeError: the process ForkProcess-3:1 (pid 11601) %s while writing "
        "/ckpt/iter_0000002/__1_0.distcp (%s)" % (WRITER_KILLED, failed_saves_raise_everywhere.NOTE),
    ]


TEXT_BLOCKS = [(page, body) for page in PAGES for lang, body in blocks(page) if lang == "text"]


@pytest.mark.parametrize("page,body", TEXT_BLOCKS, ids=["%s-%d" % (p, i) for i, (p, _) in enumerate(TEXT_BLOCKS)])
def test_text_block_is_a_file_a_listing_or_a_real_error(page, body):
    for name in ("mcore_autopatch.pth", "mcore_autopatch.start"):
        with open(os.path.join(ROOT, name)) as f:
            if f.read() == body:
                return
    if any(body.strip() == error or matches(body.strip(), error) for error in known_errors()):
        return
    paths = listed_paths(body)
    assert paths, "%s: a text block that is neither a file, a listing nor a known error:\n%s" % (page, body)
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, "%s lists paths that do not exist: %s" % (page, missing)


def test_dockerfile_blocks_are_steps_of_the_tested_dockerfile():
    with open(os.path.join(ROOT, "examples", "Dockerfile")) as f:
        recipe = f.read()
    for page in PAGES:
        for lang, body in blocks(page):
            if lang == "dockerfile":
                for line in body.splitlines():
                    if line.strip() and not line.startswith("#"):
                        assert line.split("#")[0].strip() in recipe, (page, line)


# --- console blocks --------------------------------------------------------------------------


def commands(body: str) -> List[Tuple[str, str]]:
    """(command, expected output) pairs of a console block."""
    out: List[Tuple[str, List[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return [(command, "\n".join(expected)) for command, expected in out]


def make_targets() -> List[str]:
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    return re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()  # type: ignore[union-attr]


CONSOLE_PAGES = [page for page in PAGES if any(lang == "console" for lang, _ in blocks(page))]


def console_pairs(page: str) -> List[Tuple[str, str]]:
    return [pair for lang, body in blocks(page) if lang == "console" for pair in commands(body)]


# A command README.md's cell runs with the same expected output is not run again for another
# page (README.zh-CN.md repeats most of them): only the install it needs first, and its own.
RUN_FOR_README = set(console_pairs("README.md"))
INSTALL = "pip install mcore-autopatch"
# The commands on a checkpoint that lost mcore_data need one saved on torch 2.9.0: the
# everyday tier runs every other command of each page, the matrix those.
CONSOLE_CELLS = [pytest.param(page, False, id=page) for page in CONSOLE_PAGES] + [
    pytest.param(page, True, id=page + "-lost-checkpoint", marks=pytest.mark.matrix)
    for page in CONSOLE_PAGES
    if CHECKPOINT_PLACEHOLDER in page_text(page)
]


@pytest.mark.e2e
@pytest.mark.parametrize("page,on_lost_checkpoint", CONSOLE_CELLS)
def test_console_blocks_run_as_written(page, on_lost_checkpoint, wheel_path, python_without_wheel, tmp_path):
    venv = envs.clone_venv(envs.E2E, str(tmp_path / "venv"))  # starts without mcore-autopatch
    bin_dir = os.path.dirname(venv)
    env: Dict[str, str] = clean_env(PYTHONPATH=mcore_folder("0.12.1"))
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    checkout = ""
    for body in [body for lang, body in blocks(page) if lang == "console"]:
        for command, expected in commands(body):
            if page != "README.md" and (command, expected) in RUN_FOR_README and command != INSTALL:
                continue
            if command.startswith("make "):
                assert command.split()[1] in make_targets(), (page, command)
                if command != "make wheel":
                    continue
            if command == INSTALL:
                install_wheel(venv, wheel_path)
                continue
            cwd = str(tmp_path)
            if command == "make wheel" or command.startswith("pip install "):
                checkout = checkout or checkout_for_make(tmp_path / "checkout")
                cwd = checkout
                # `python -m pip`: the clone's bin/pip is a hard link whose first line names the
                # cached venv's python, so it would install there.
                command = "python -m " + command if command.startswith("pip ") else command
            else:
                assert command.startswith("mcore-autopatch "), "%s: no rule to check `%s`" % (page, command)
            if (CHECKPOINT_PLACEHOLDER in command) is not on_lost_checkpoint:
                continue
            if CHECKPOINT_PLACEHOLDER in command:
                from test_e2e_job_path import LOST_TORCH

                python_without_wheel(LOST_TORCH)  # skips where torch 2.9.0 is not part of the run
                folder = str(tmp_path / "checkpoint")
                if not os.path.isdir(folder):
                    shutil.copytree(_lost(python_without_wheel), folder)
                command = command.replace(CHECKPOINT_PLACEHOLDER, folder)
                expected = expected.replace(CHECKPOINT_PLACEHOLDER, folder)
            proc = subprocess.run(
                ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=300, cwd=cwd
            )
            assert proc.returncode == 0 or command.startswith("mcore-autopatch "), (page, command, proc.stderr)
            assert "Traceback" not in proc.stderr, proc.stderr
            assert matches(expected, proc.stdout), "%s: `%s` printed:\n%s\nexpected:\n%s" % (
                page,
                command,
                proc.stdout,
                expected,
            )


def _lost(python_without_wheel: Any) -> str:
    from test_e2e_job_path import lost_checkpoint

    return os.path.join(lost_checkpoint(python_without_wheel)["root"], "iter_0000003")


# --- the Chinese quick start keeps in step ------------------------------------------------------


def named(text: str) -> Dict[str, set]:
    flat = re.sub(r"\s+", " ", text)
    return {
        "commands": set(
            re.findall(r"\b(?:mcore-autopatch (?:status|check|selftest|inspect|repair)|make (?:demo|test)\b)", flat)
        )
        | ({"pip install mcore-autopatch"} if "pip install mcore-autopatch" in flat else set()),
        "variables": set(re.findall(r"\bMCORE_AUTOPATCH\w*", flat)),
        "errors": {e for e in ERROR_TEXTS if e in flat},
    }


def test_chinese_quick_start_names_the_same_commands_variables_and_errors():
    english = named(page_text("README.md") + page_text("docs/troubleshooting.md"))
    chinese = named(page_text("README.zh-CN.md"))
    assert chinese["commands"] == english["commands"]
    assert chinese["variables"] == english["variables"]
    assert chinese["errors"] == english["errors"] == set(ERROR_TEXTS)


def test_documented_variables_and_values_are_the_codes():
    import mcore_autopatch
    from mcore_autopatch import fixes
    from mcore_autopatch.shared import log

    for page in ("README.md", "README.zh-CN.md"):
        text = page_text(page)
        assert set(re.findall(r"\bMCORE_AUTOPATCH\w*", text)) == {"MCORE_AUTOPATCH", log.LOG_ENV, fixes.SKIP_ENV}
        for word in (*mcore_autopatch._OFF_WORDS, "auto", "force", *log.LEVELS):
            assert "`%s`" % word in text, (page, word)
