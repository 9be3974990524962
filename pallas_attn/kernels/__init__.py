"""Pallas GPU kernels (Triton lowering); one file per kernel family."""
