# One entry point for set-up, the demo and the tests.  Everything installs into .venv.
#   make demo   - train an FSDP2 job on 2 CPU ranks, save through a ckptd daemon, reload at 3
#   make test   - the whole test suite (multi-rank, daemon, SeaweedFS S3, property tests)
# GPU machines: `make TORCH_SPEC=torch install` (or pre-install your torch into .venv) keeps a
# CUDA build; the default pins the CPU wheel so a fresh CPU box does not pull CUDA.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.ckptd-installed

.PHONY: install demo test lint proto clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	# byte-compile the project as a non-editable pip install does: with PYTHONDONTWRITEBYTECODE
	# set, every `ckptd` start would otherwise compile its modules from source (~60 ms)
	$(BIN)/python -m compileall -q ckptd client/ckptd_client
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ckptd demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/python -m ruff check ckptd client tests bench || true

proto: $(STAMP)
	PYTHON=$(BIN)/python scripts/gen_proto.sh

clean:
	rm -rf $(VENV) demo-out .pytest_cache .hypothesis
