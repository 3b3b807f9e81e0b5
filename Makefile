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

$(BIN)/scale-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	-$(BIN)/pip install -q --upgrade pip            # best effort
	$(BIN)/pip install -q "$(TORCH)"            # first, so that no other package pulls a multi-GB CUDA build
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
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
