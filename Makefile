# Quick start: `make demo` (the bug and the fix, for real) and `make test`.
# Recipes are not echoed: stdout carries only what a target produces (a path, a hash, a
# table, test reports); the tools say what they do on stderr.
# Everything is built into ignored folders: .cache/ (test environments), .venv/ (demo), dist/.
# Nor does make announce directories on stdout when it runs inside another make.
MAKEFLAGS += --no-print-directory
PYTHON ?= python3
TOOLS := .cache/tools/bin/python

.PHONY: demo test test-matrix test-env test-matrix-env peer-tests gpu-check gpu-check-prepare wheel lint bench compat-table clean

demo:
	@$(PYTHON) tools/demo.py

# The everyday tier (README, CI first): ruff, then every test not marked `matrix`, on torch
# 2.13.0 (the CPU wheel on this disk) and its numpy 2 clone. About 1.5 GB of environments.
test-env:
	@$(PYTHON) tools/envs.py everyday

test: test-env
	@$(TOOLS) -m ruff check .
	@MCORE_AUTOPATCH_TEST_TIER=everyday $(TOOLS) -m pytest -n 3 --dist worksteal --timeout 900 -p no:cacheprovider --durations=25 -m "not matrix"

# The full matrix (CI second): the real CUDA torch releases, numpy 1.26, CPython 3.12, the
# seed stack with Ray, the other CPythons, the release sweeps. About 29 GB of environments.
test-matrix-env:
	@$(PYTHON) tools/envs.py

test-matrix: test-matrix-env
	@MCORE_AUTOPATCH_TEST_TIER=matrix $(TOOLS) -m pytest -n 3 --dist worksteal --timeout 900 -p no:cacheprovider --durations=25 -m matrix

# Megatron-LM's own dist_checkpointing tests (a checkout of core_v0.12.1 you give it:
# MEGATRON_LM=/path/to/Megatron-LM) on 8 CPU ranks, torch 2.15.0, numpy 2, with the wheel;
# the table of what fails and why on stdout (docs/testing.md). Not in CI: it has no checkout.
peer-tests: test-env
	@$(PYTHON) tools/peer_tests.py

# The GPU variants of the end-to-end tests, for a machine with a GPU and no registry:
# prepare .gpu-check/ here, carry it, run `make gpu-check` there (tools/gpu_check.sh).
gpu-check-prepare:
	@$(PYTHON) tools/envs.py gpu-check

gpu-check:
	@tools/gpu_check.sh

# The wheel in dist/ and its sha256 (reproducible: the same commit gives the same hash;
# pin it with `pip install --require-hashes`, see examples/Dockerfile).
# tools/envs.py writes progress to stderr; its stdout is the wheel's path and nothing else.
wheel:
	@whl="$$($(PYTHON) tools/envs.py wheel)" || { echo "make wheel: building the wheel failed (above)" >&2; exit 1; }; \
	if [ ! -f "$$whl" ]; then echo "make wheel: tools/envs.py wheel printed no wheel path: '$$whl'" >&2; exit 1; fi; \
	echo "$$whl"; sha256sum "$$whl"

lint: test-env
	@$(TOOLS) -m ruff check .

bench: test-env
	@$(PYTHON) bench/run_all.py

# docs/compatibility.md's tables, from the last `make test` run.
compat-table:
	@$(PYTHON) tools/compat_table.py --update

clean:
	@rm -rf .cache .venv .gpu-check build dist *.egg-info
