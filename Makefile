# The two commands on a fresh machine (Python >= 3.10, make):
#   make train    set up .venv, then run the main job (scale-train; ARGS="key=value ..." to override)
#   make test     set up .venv, then run the unit tests, then the multi-process launch and slow tests
# TORCH picks the torch build: the default is the CPU wheel; on a CUDA machine run `make train TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?= qlora,wandb,report,deepspeed,test
BIN := $(VENV)/bin

.PHONY: setup train test test-unit test-launch test-heavy

# uv installs what pip would (the best version over every index, as pip picks; pip's own sources handed over by
# .ci/uv_flags.py, uv reads no pip.conf) in ~50 s instead of pip's ~130 s on 2 cores. INSTALL=pip, or any failure of
# uv, installs with pip.
INSTALL ?= uv
UV = $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode --index-strategy unsafe-best-match \
	$$($(BIN)/python .ci/uv_flags.py)

$(BIN)/scale-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	-$(BIN)/pip install -q --upgrade pip            # best effort
	if [ "$(INSTALL)" = uv ] && $(BIN)/pip install -q uv && $(UV) "$(TORCH)" && $(UV) -e '.[$(EXTRAS)]'; then :; else \
	  $(BIN)/pip install -q "$(TORCH)" && $(BIN)/pip install -q -e '.[$(EXTRAS)]'; fi   # torch first: no CUDA pull
	touch $@

setup: $(BIN)/scale-train

train: setup
	$(BIN)/scale-train $(ARGS)

test-unit: setup
	$(BIN)/python -m pytest -q

test-launch: setup
	$(BIN)/python -m pytest -q -m '(launch or slow) and not heavy'   # multi-process launches, whole jobs, W&B

test-heavy: setup      # not in `make test`: the planner against counts on the real SmolLM2-135M shape (~10 min)
	$(BIN)/python -m pytest -q -m heavy

test: test-unit test-launch
