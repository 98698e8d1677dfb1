# Two commands on a fresh machine: `make run` (main job on built-in data) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
export OMP_NUM_THREADS := 1
export OPENBLAS_NUM_THREADS := 1
export MKL_NUM_THREADS := 1
export NUMBA_NUM_THREADS := 1

.PHONY: run test install bench-sim clean

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

bench-sim: install
	$(VENV)/bin/hdamoe bench-sim

clean:
	rm -rf $(VENV) build *.egg-info
