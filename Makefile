# One machine, no containers: everything runs from the venv.
# GPU machines: `make venv TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`
# (or pre-install the CUDA build of torch in the venv; the project only asks for torch>=2.3).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
WORKLOAD ?= mixed
MODES ?= fleet,baseline,limit
PYTEST_ARGS ?=
UP_ARGS ?=

.PHONY: venv up down status flower demo test lint bench soak chaos gpu-check coldstart scaleout k8s-render clean

venv: $(VENV)/.installed

# One pip command with the torch pin keeps the CPU build (an unpinned torch pulls CUDA, ~3 GB).
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH_SPEC) -e '.[dev]'
	touch $@

# make up UP_ARGS="--replicas text=2,image=1" (any `fleet up` option)
up: venv
	$(BIN)/fleet up $(UP_ARGS)

down:
	@if [ -x $(BIN)/fleet ]; then $(BIN)/fleet down; fi

status: venv
	$(BIN)/fleet status

flower: venv
	$(BIN)/fleet flower

# On a stack of its own (free ports, run dir .run/demo): a `make up` stack keeps running.
demo: venv
	$(BIN)/fleet demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

# Fleet vs plain-Celery baseline vs in-process limit; method: producer/bench/README.md.
# Through the HTTP gateway too: make bench WORKLOAD=text-saturate MODES=fleet,gateway
bench: venv
	$(BIN)/fleet bench $(WORKLOAD) --modes $(MODES)

soak: venv
	$(BIN)/fleet soak

# Faults injected into a real stack under load (configs/chaos.toml); writes reports/chaos.json.
# CI runs the short version (tests/integration/test_chaos_short.py).
chaos: venv
	$(BIN)/fleet chaos

# Kubernetes: cold start and service rate of one fresh worker per modality (what the startup
# probe budget and the KEDA targets in deploy/k8s derive from; deploy/k8s/measured.json).
coldstart: venv
	@mkdir -p reports
	$(BIN)/python -m producer.bench.coldstart --modalities text,image,video,xmodal --out reports/coldstart.json

# Redis commands and CPU per request, then 1-100 worker hosts simulated (docs/scale-out.md).
scaleout: venv
	@mkdir -p reports
	$(BIN)/python -m producer.bench.redisload --out reports/redisload.json
	$(BIN)/python -m producer.bench.scaleout --redis reports/redisload.json

# Both overlays rendered and validated (what tests/deploy checks in CI).
k8s-render: venv
	@mkdir -p reports
	for o in cpu gpu; do kubectl kustomize deploy/k8s/overlays/$$o > reports/k8s-$$o.yaml || exit 1; done
	$(BIN)/pytest -q tests/deploy/test_manifests.py

gpu-check: venv
	$(BIN)/python -m workers.gpu_check

clean: down
	rm -rf .run reports .pytest_cache .ruff_cache
