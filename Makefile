# Two commands on a fresh machine: `make run` (main job on built-in data) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
export OMP_NUM_THREADS := 1
export OPENBLAS_NUM_THREADS := 1
export MKL_NUM_THREADS := 1
export NUMBA_NUM_THREADS := 1

.PHONY: run test install bench-sim docs docs-check clean

$(VENV)/.installed: pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[all]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/hdamoe bench --json runs/bench.json --resume --plots runs/plots

test: install
	$(PY) -m pytest -q

# the outputs of the examples in README.md and docs/*.md (`<!-- example: run -->` blocks);
# regenerate after a physics change; `docs-check` fails on stale outputs (CI)
docs: install
	$(PY) -m benchmarks.docs_examples --write --slow

docs-check: install
	$(PY) -m benchmarks.docs_examples --check --run-python

bench-sim: install
	$(VENV)/bin/hdamoe bench-sim

clean:
	rm -rf $(VENV) build *.egg-info
