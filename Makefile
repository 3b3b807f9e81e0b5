# The two commands on a fresh machine (Python >= 3.10, make):
#   make train    set up .venv, then run the main job (scale-train; ARGS="key=value ..." to override)
#   make test     set up .venv, then run the unit tests on the newest and on the lowest declared versions, then the
#                 multi-process launch and slow tests
# TORCH picks the torch build: the default is the CPU wheel; on a CUDA machine run `make train TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?= qlora,wandb,report,deepspeed,test,bench
# the lowest-versions tier: without bench (trl needs datasets and pyyaml above our lower bounds)
LOWEST_EXTRAS ?= qlora,wandb,report,deepspeed,test
BIN := $(VENV)/bin

LOWEST ?= .venv-lowest
.PHONY: setup train test test-unit test-newest test-lowest test-launch test-heavy gpu-check wheelhouse

# uv installs what pip would (the best version over every index, as pip picks; pip's own sources handed over by
# .ci/uv_flags.py, uv reads no pip.conf) in ~50 s instead of pip's ~130 s on 2 cores. INSTALL=pip, or any failure of
# uv, installs with pip.
INSTALL ?= uv
# Offline install (GPU nodes often have no network): WHEELS=dir installs with pip from that directory only
# (--no-index; `make wheelhouse` fills it on a connected machine), build backend included.
WHEELS ?=
ifneq ($(WHEELS),)
export PIP_NO_INDEX := 1
export PIP_FIND_LINKS := $(abspath $(WHEELS))
INSTALL := pip
endif
UV = $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode --index-strategy unsafe-best-match \
	--resolution highest $$($(BIN)/python .ci/uv_flags.py)

$(BIN)/scale-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	-$(BIN)/pip install -q --upgrade pip            # best effort
	if [ "$(INSTALL)" = uv ] && $(BIN)/pip install -q uv && $(UV) "$(TORCH)" && $(UV) -e '.[$(EXTRAS)]'; then :; else \
	  $(BIN)/pip install -q "$(TORCH)" && $(BIN)/pip install -q -e '.[$(EXTRAS)]'; fi   # torch first: no CUDA pull
	touch $@

setup: $(BIN)/scale-train

train: setup
	$(BIN)/scale-train $(ARGS)

# The newest tier: .venv holds the newest release of every dependency the registry serves (uv's highest resolution),
# upgraded in place first (~10 s when nothing is newer), so the unit tier meets an upper-side break the day it is
# released. torch stays $(TORCH): the CPU wheel; PyPI's newer Linux torch wheels (2.14.1, 2.15.0) are CUDA builds.
test-newest: setup
	if [ -x $(BIN)/uv ]; then $(UV) --upgrade "$(TORCH)" -e '.[$(EXTRAS)]'; \
	else $(BIN)/pip install -q --upgrade "$(TORCH)" -e '.[$(EXTRAS)]'; fi
	$(BIN)/scale-env | grep -E '^- (torch|accelerate|transformers|peft|datasets):'

test-unit: test-newest
	$(BIN)/python -m pytest -q

# The lowest tier: a second venv with each direct dependency at pyproject.toml's lower bound (.ci/lowest.py pins every
# `>=` bound with `==`; a bound that cannot install with the others fails here) and the unit tier run in it. torch
# stays $(TORCH): PyPI's Linux wheels of older torch are multi-GB CUDA builds.
$(LOWEST)/bin/scale-train: pyproject.toml .ci/lowest.py | setup
	rm -rf $(LOWEST) && $(PYTHON) -m venv $(LOWEST)
	$(BIN)/python .ci/lowest.py > $(LOWEST)/lowest.txt
	$(BIN)/pip install -q uv
	$(BIN)/uv pip install -q --python $(LOWEST)/bin/python --index-strategy unsafe-best-match \
	  $$($(BIN)/python .ci/uv_flags.py) -c $(LOWEST)/lowest.txt "$(TORCH)" -e '.[$(LOWEST_EXTRAS)]'
	touch $@

test-lowest: $(LOWEST)/bin/scale-train
	$(LOWEST)/bin/scale-env | grep -E '^- (torch|accelerate|transformers|peft|datasets):'
	$(LOWEST)/bin/python -m pytest -q

test-launch: setup
	$(BIN)/python -m pytest -q -m '(launch or slow) and not heavy'   # multi-process launches, whole jobs, W&B

test-heavy: setup      # not in `make test`: the planner against counts on the real SmolLM2-135M shape (~10 min)
	$(BIN)/python -m pytest -q -m heavy

test: test-unit test-lowest test-launch

# The GPU proof in one command on a CUDA machine: make gpu-check TORCH=torch [WHEELS=dir]. pytest -m gpu, LoRA/QLoRA
# throughput and MFU, memory against scale-plan, harness against a bare loop, fp32 device-vs-CPU parity, the default
# job at the largest micro-batch that fits, casts, MoE LoRA, GRPO with the vLLM generator; one report, gpu_check.md
# (benchmarks/gpu_check.py; ARGS="--skip bare").
gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py --out gpu_check.md $(ARGS)

# On a connected machine of the GPU node's platform: every wheel `make gpu-check TORCH=torch` installs (CUDA torch,
# the extras, the build backend) into $(WHEELHOUSE); copy it over and run make gpu-check WHEELS=$(WHEELHOUSE) there.
# Another platform: WHEEL_FLAGS="--platform manylinux_2_28_x86_64 --python-version 3.11 --only-binary=:all:".
WHEELHOUSE ?= wheelhouse
GPU_TORCH ?= torch
WHEEL_FLAGS ?=
wheelhouse:
	$(PYTHON) -m pip download -q -d $(WHEELHOUSE) $(WHEEL_FLAGS) "$(GPU_TORCH)" "setuptools>=77" wheel pip uv '.[$(EXTRAS)]'
