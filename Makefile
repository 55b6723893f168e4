# make bench : the main job, the benchmark (interpret mode at small sizes on a CPU)
# make test  : the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
JOBS ?= 2

$(VENV)/.installed: pyproject.toml constraints.txt
	$$(scripts/find_python.sh) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	touch $@

.PHONY: venv test bench gpu clean
venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(JOBS) tests

bench: $(VENV)/.installed
	$(PY) experiments/benchmark.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
