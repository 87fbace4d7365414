# rasterscale: `make demo` runs the workflow on the demo config, `make test` runs the test suite.
# Both create .venv from the pinned envs/requirements.txt when it is missing or older than the pins.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= $(shell nproc)

.PHONY: demo test lint format bench bench-scenes clean

$(STAMP): envs/requirements.txt
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found (set PYTHON=/path/to/python3.11)"; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	# exact pins: the machine-local torch wheel (another version) can never be picked
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --prefer-binary -r envs/requirements.txt
	$(BIN)/python -c "import torch, torchvision.ops; torchvision.ops.nms(torch.zeros(1, 4), torch.ones(1), 0.5)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/snakemake --cores $(CORES)

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check scripts tests bench
	$(BIN)/ruff format --check scripts tests bench
	$(BIN)/snakefmt --check Snakefile rules
	$(BIN)/snakemake --lint -n

format: $(STAMP)
	$(BIN)/ruff format scripts tests bench
	$(BIN)/snakefmt Snakefile rules

bench: $(STAMP)
	$(BIN)/python bench/run.py

# many small scenes against one of the same pixels (bench/many_scenes.py; --side 1024 --per-scene 200: full sizes)
bench-scenes: $(STAMP)
	$(BIN)/python bench/many_scenes.py

clean:
	rm -rf results logs benchmarks .snakemake
