"""The benchmark's modules; `experiments/benchmark.py` is the entry point."""
