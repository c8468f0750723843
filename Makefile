# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
MODEL ?= gpt2
CORPUS ?= corpora/sentences.txt
OUT ?= outputs

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

# torch goes first, pinned: on our machines that picks the CPU wheel on disk, while an
# unpinned torch pulled in by the package would fetch a CUDA build of several GB.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
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
