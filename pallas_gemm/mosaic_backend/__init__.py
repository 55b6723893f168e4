"""Mosaic GPU (Hopper) backend: wgmma, TMA, warp specialisation."""
