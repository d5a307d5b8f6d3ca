# One machine, no containers: everything runs from the venv.
# GPU machines: `make venv TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`
# (or pre-install the CUDA build of torch in the venv; the project only asks for torch>=2.3).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
WORKLOAD ?= mixed
MODES ?= fleet,baseline,limit
METRICS_COST ?=
COST_ROUNDS ?= 4
COST_ROUND_S ?= 0
PYTEST_ARGS ?=
# make test runs its test files in this many processes (pytest-xdist, one file per process at a
# time: a file's fixtures and its stack stay in one process); 1 runs them in this process.
TEST_WORKERS ?= 2
UP_ARGS ?=

.PHONY: venv peers precision up down status flower demo test lint docs bench soak chaos gpu-check coldstart scaleout k8s-render ha-check clean

venv: $(VENV)/.installed

# One pip command with the torch pin keeps the CPU build (an unpinned torch pulls CUDA, ~3 GB).
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH_SPEC) -e '.[dev]'
	touch $@

# The bench's peers (celery-batches, Ray Serve) in a venv of their own: celery-batches requires
# celery<5.7, which would downgrade the fleet's Celery. `make bench MODES=fleet,celery-batches,ray-serve`
peers: $(VENV)-peers/.installed

$(VENV)-peers/.installed: pyproject.toml
	test -x $(VENV)-peers/bin/python || $(PY) -m venv $(VENV)-peers
	$(VENV)-peers/bin/python -m pip install -q --disable-pip-version-check $(TORCH_SPEC) -e '.[peers]'
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

# The documentation site (mkdocs.yml: README.md and docs/), strict: a broken link, a missing
# page or an anchor that is not there fails it. Output in build/site (ignored by git).
docs: venv
	$(BIN)/mkdocs build --strict --site-dir build/site

test: lint docs
	$(BIN)/pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

# Fleet vs plain-Celery baseline vs in-process limit; method: producer/tools/bench/README.md.
# Through the HTTP gateway too: make bench WORKLOAD=text-saturate MODES=fleet,gateway
# Metrics + tracing (1 %) on vs off instead of the modes, interleaved in one run:
# make bench WORKLOAD=text-saturate METRICS_COST=1 [COST_ROUNDS=4] [COST_ROUND_S=15]
# Modes run interleaved by repetition; SEQUENTIAL=1 runs each mode's repetitions in a row.
# What the fleet costs per request (identity model, CPU by process, Redis per request):
# make bench WORKLOAD=overhead-saturate MODES=fleet,baseline,celery-batches,ray-serve,redis-limit
# WORKERS=text=4: worker processes per modality (fleet, baseline, gateway).
bench: venv
	$(if $(WORKERS),FLEET_BENCH_WORKERS=$(WORKERS)) $(BIN)/fleet bench $(WORKLOAD) --modes $(MODES) $(if $(filter 1 yes true,$(SEQUENTIAL)),--sequential) $(if $(filter 1 yes true,$(METRICS_COST)),--metrics-cost \
		--cost-rounds $(COST_ROUNDS) --cost-round-s $(COST_ROUND_S))

# A reduced-precision text model vs fp32, in-process: cosine per text, the demo's semantic
# check, throughput (reports/precision.json). PRECISION=int8 (CPU) or fp16/bf16 (CUDA).
PRECISION ?= int8
precision: venv
	$(BIN)/python -m producer.tools.bench.precision --precision $(PRECISION)

soak: venv
	$(BIN)/fleet soak

# Faults injected into a real stack under load (configs/chaos.toml); writes reports/chaos.json.
# CI runs the short version (tests/integration/test_chaos_short.py).
chaos: venv
	$(BIN)/fleet chaos

# Redis high availability: a primary, a replica and 3 sentinels on loopback, 2 text workers;
# SENTINEL FAILOVER, then SIGKILL of the primary, each with HA_REQUESTS requests in flight;
# every request's final state counted (reports/ha.json). CI: tests/integration/test_ha_failover.py.
HA_REQUESTS ?= 2000
ha-check: venv
	@mkdir -p reports
	$(BIN)/python -m producer.tools.chaos.ha --requests $(HA_REQUESTS) --out reports/ha.json

# Kubernetes: cold start and service rate of one fresh worker per modality (what the startup
# probe budget and the KEDA targets in deploy/k8s derive from; deploy/k8s/measured.json).
coldstart: venv
	@mkdir -p reports
	$(BIN)/python -m producer.tools.bench.coldstart --modalities text,image,video,xmodal --out reports/coldstart.json

# Redis commands and CPU per request, for the MiniLM text model and the identity model (no
# compute: the fleet's own path), then 1-100 worker hosts simulated for each and the request
# rate at which one Redis saturates (docs/scale-out.md). SCALEOUT_WORKERS=N: N text workers
# in each measurement (default 1).
SCALEOUT_WORKERS ?= 1
scaleout: venv
	@mkdir -p reports
	for m in minilm identity; do $(BIN)/python -m producer.tools.bench.redisload --model $$m \
		--workers $(SCALEOUT_WORKERS) --out reports/redisload-$$m.json > /dev/null || exit 1; done
	$(BIN)/python -m producer.tools.bench.scaleout --redis reports/redisload-minilm.json \
		--redis reports/redisload-identity.json --json reports/scaleout.json

# Both overlays rendered and validated (what tests/deploy checks in CI).
k8s-render: venv
	@mkdir -p reports
	for o in cpu gpu; do kubectl kustomize deploy/k8s/overlays/$$o > reports/k8s-$$o.yaml || exit 1; done
	$(BIN)/pytest -q tests/deploy/test_manifests.py

# A page per day of the reports in reports/ (bench, chaos, HA, cold start, soak...) under
# docs/measurements/, and its index; pages without the generator's first line are never written.
.PHONY: measurements
measurements: venv
	$(BIN)/python -m producer.tools.measurements --reports reports --out docs/measurements

# On a CUDA machine, within 10 minutes: the device runtime's checks, then short benches
# (overhead-saturate's fleet + redis-limit on the identity model, text- and image-saturate on
# CUDA); reports/gpucheck.json and reports/gpucheck/. Without CUDA it prints that it skipped;
# GPU_CHECK_PARTS=overhead runs what needs no GPU (parts: checks,overhead,text,image).
gpu-check: venv
	$(BIN)/python -m producer.tools.gpucheck --out reports/gpucheck.json \
		$(if $(GPU_CHECK_PARTS),--parts $(GPU_CHECK_PARTS))

clean: down
	rm -rf .run reports .pytest_cache .ruff_cache
