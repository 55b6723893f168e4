"""The foundation's first Pallas kernel through the shared suite."""

from kernel_test_base import KernelTestBase


class TestKLoop(KernelTestBase):
  KERNELS = ("triton/02_k_loop",)
