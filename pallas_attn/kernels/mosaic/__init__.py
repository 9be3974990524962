"""Pallas kernels on Mosaic GPU (Hopper: TMA, wgmma), one file per kernel family."""
