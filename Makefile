# make bench : the main job, the benchmark (interpret mode at small sizes on a CPU)
# make test  : the test suite (interpret mode on a CPU; compiled kernels on a GPU)
#
# Both set up their environment first (scripts/setup_env.sh): an interpreter
# that already has CUDA jax is used as it is (the project alone is installed
# into it), otherwise a .venv with jax pinned and, when an NVIDIA driver is
# found, the matching jax CUDA extra. PALLAS_GEMM_ENV=current|venv and
# PALLAS_GEMM_DEVICE=cpu|cuda12|cuda13 override the detection.
# pytest workers: one per core, at most 6 (a GPU machine's suite shares one
# device; a 2-core CI gets 2).
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 6 ] && n=6; echo $$n)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: venv test bench clean
venv:
	@scripts/setup_env.sh >/dev/null

test:
	@PY=$$(scripts/setup_env.sh) && $$PY -m pytest -q -n $(JOBS) tests

bench:
	@PY=$$(scripts/setup_env.sh) && $$PY experiments/benchmark.py $(ARGS)

clean:
	rm -rf .venv build *.egg-info
