"""Raw CUDA kernels bridged with jax.ffi."""
