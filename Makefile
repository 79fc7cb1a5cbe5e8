# Two commands set everything up on a fresh machine:
#   make demo   the main job, `tailtamer train` on the built-in default (creates .venv on first use)
#   make test   the test suite (CPU, a few minutes)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# PyTorch as the package index has it (PyPI's Linux wheel is the CUDA build; for the smaller
# CPU build: make TORCH_INDEX=https://download.pytorch.org/whl/cpu). The package itself only
# asks for torch>=2.5, so GPU users keep theirs.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: demo test test-fast bench venv clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/tailtamer train

test: venv
	$(BIN)/python -m pytest

test-fast: venv
	$(BIN)/python -m pytest -m "not slow"

bench: venv
	$(BIN)/tailtamer bench decode --out runs/bench-decode.json

clean:
	rm -rf $(VENV) runs .pytest_cache
