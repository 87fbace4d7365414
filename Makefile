# rasterscale: `make demo` runs the workflow on the demo config, `make test` runs the test suite,
# `make docs` writes docs/configuration.md from config/schema.yaml, `make envs` envs/environment.yaml (the rules'
# conda environment) from envs/requirements.txt.
# The others create .venv from the pinned envs/requirements.txt when it is missing or older than the pins.

# The newest Python 3.13, 3.12 or 3.11 on the PATH that runs and can make a venv (a pyenv shim of a version that
# is not active is on the PATH but does not run); PYTHON=/path/to/python overrides.
ifndef PYTHON
PYTHON := $(shell for v in 3.13 3.12 3.11; do \
	python$$v -c 'import venv, ensurepip' >/dev/null 2>&1 && { command -v python$$v; break; }; done)
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= $(shell nproc)

.PHONY: demo demo-segmentation demo-instances demo-height demo-points demo-byom test docs envs lint format bench bench-gpu device-kit bench-scenes bench-parse bench-continental bench-project bench-rgbn bench-deepforest test-deepforest test-peers clean

$(STAMP): envs/requirements.txt
	@test -n "$(PYTHON)" || { echo "make: no Python 3.11, 3.12 or 3.13 (with venv) on the PATH: set PYTHON=/path/to/python3.x"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' || \
		{ echo "make: $(PYTHON) is not Python 3.11-3.13"; exit 1; }
	@echo "make: creating $(VENV) with $(PYTHON) ($$($(PYTHON) -V))"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	# exact pins: the machine-local torch wheel (another version) can never be picked
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --prefer-binary -r envs/requirements.txt
	$(BIN)/python -c "import torch, torchvision.ops; torchvision.ops.nms(torch.zeros(1, 4), torch.ones(1), 0.5)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/snakemake --cores $(CORES)

demo-segmentation: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) --configfile config/segmentation.yaml

demo-instances: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) --configfile config/instances.yaml

demo-height: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) --configfile config/height.yaml

# tree tops as points (task: points): trained on one synthetic scene's true tops, scored on the other's within 1 m
demo-points: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) --configfile config/points.yaml

# bring your own model: the segmentation demo's model exported to ONNX, TorchScript and torch.export, each form
# predicting the held-out scene as model.file with its card (scripts/rasterscale/tools/byom.py): mIoU within 0.005
demo-byom: demo-segmentation
	$(BIN)/python scripts/demo_byom.py --cores $(CORES)

test: $(STAMP)
	$(BIN)/python -m pytest

docs: $(STAMP)
	$(BIN)/python scripts/config_reference.py --out docs/configuration.md

# the rules' conda environment (`snakemake --sdm conda`) lists the pins of envs/requirements.txt itself: Snakemake
# creates it from that file alone (scripts/rasterscale/tools/condaenv.py). Standard library only: no .venv needed.
envs:
	@test -n "$(PYTHON)" || { echo "make: no Python 3.11, 3.12 or 3.13 (with venv) on the PATH: set PYTHON=/path/to/python3.x"; exit 1; }
	$(PYTHON) scripts/conda_env.py --requirements envs/requirements.txt --out envs/environment.yaml

lint: $(STAMP)
	$(BIN)/ruff check scripts tests bench
	$(BIN)/ruff format --check scripts tests bench
	$(BIN)/mypy
	PYTHONPATH=scripts $(BIN)/lint-imports pyproject.toml
	$(BIN)/snakefmt --check Snakefile rules
	$(BIN)/snakemake --lint -n

format: $(STAMP)
	$(BIN)/ruff format scripts tests bench
	$(BIN)/snakefmt Snakefile rules

bench: $(STAMP)
	$(BIN)/python bench/run.py

# GPU acceptance (bench/gpu.py, results/bench-gpu.json and .txt): on every visible GPU, training and prediction at
# auto and 32-true, the job against the pure forward at DeepForest's scale, torch.compile kept or not, NVML
# utilization and peak memory per rank, pinned copies and data wait. Without CUDA (or with `--cpu`, e.g.
# `.venv/bin/python bench/gpu.py --cpu`) the same code on tiny sizes on CPU ranks, as tests/test_bench_gpu.py runs it.
bench-gpu: $(STAMP)
	$(BIN)/python bench/gpu.py

# the same on a lent GPU machine, whose image has its own torch and Lightning and reaches no registry: the packages
# it lacks (bench/device/carry.txt, at this environment's versions, for its CPython 3.12) packed into
# .gpu-kit/site-cp312.tar.xz (about 51 MiB), which bench/device/bench-gpu.sh unpacks there before bench/gpu.py
device-kit: $(STAMP)
	$(BIN)/python bench/device/kit.py

# many small scenes against one of the same pixels (bench/many_scenes.py; --side 1024 --per-scene 200: full sizes)
bench-scenes: $(STAMP)
	$(BIN)/python bench/many_scenes.py

# a 2 x 2 cut of a synthetic scene predicted as a project against the whole scene, near the inner borders
# (bench/project_borders.py: trains a detector first, about 10 min on 2 cores)
bench-project: $(STAMP)
	$(BIN)/python bench/project_borders.py

# a DeepForest RGB model folder fine-tuned on RGBN against scratch, same steps, and at step 0 (bench/rgbn_start.py)
bench-rgbn: $(STAMP)
	$(BIN)/python bench/rgbn_start.py

# a simulated continental run: a STAC ItemCollection of 200,000 items planned by snakemake -n, two batches run for
# real, every process's time and peak RSS (bench/continental.py; --items N, --source survey: local rasters)
bench-continental: $(STAMP)
	$(BIN)/python bench/continental.py

# how long Snakemake parses the workflow with 1000 scenes: dry run, a job's re-parse (bench/parse_time.py; --scenes N)
bench-parse: $(STAMP)
	$(BIN)/python bench/parse_time.py

# DeepForest 2.1.0 in an environment of its own (not a runtime dependency), for the side-by-side bench and the
# test that a model folder rasterscale writes loads and predicts in DeepForest.
DF_VENV := .venv-deepforest
DF_STAMP := $(DF_VENV)/.installed

$(DF_STAMP): bench/deepforest/requirements.txt
	rm -rf $(DF_VENV)
	$(PYTHON) -m venv $(DF_VENV)
	$(DF_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --prefer-binary -r bench/deepforest/requirements.txt
	touch $(DF_STAMP)

bench-deepforest: $(STAMP) $(DF_STAMP)
	$(BIN)/python bench/side_by_side.py --deepforest-python $(DF_VENV)/bin/python

test-deepforest: $(STAMP) $(DF_STAMP)
	$(DF_VENV)/bin/python -m pytest -p no:cacheprovider -c /dev/null --rootdir . bench/deepforest -q

# TorchGeo 0.8.1, ONNX and ONNX Runtime in an environment of their own (not runtime dependencies), for the test that
# a TorchGeo model exported as TorchScript, torch.export and ONNX predicts a raster through the workflow as TorchGeo
# does, and that TorchGeo-style encoder weights load into rasterscale's training (bench/peers; not part of `make test`).
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP): bench/peers/requirements.txt
	rm -rf $(PEERS_VENV)
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --prefer-binary -r bench/peers/requirements.txt
	touch $(PEERS_STAMP)

test-peers: $(STAMP) $(PEERS_STAMP)
	$(PEERS_VENV)/bin/python -m pytest -p no:cacheprovider -c /dev/null --rootdir . bench/peers -q

clean:
	rm -rf results logs benchmarks .snakemake
