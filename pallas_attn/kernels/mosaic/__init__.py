"""Pallas kernels on Mosaic GPU (Hopper: TMA, wgmma, warp specialisation), one file per kernel
family; what JAX's GPU interpreter and the sm_90a compiler accept is listed in ``common``."""
