"""Investigation scripts (sweeps, knobs, Nsight, SASS); see README.md."""
