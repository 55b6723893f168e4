"""Grouped GEMM for mixture-of-experts: `pallas_gemm.ragged_dot` (work in progress)."""
