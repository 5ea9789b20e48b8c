"""klotski_runtime: executes klotski_sim schedules with PyTorch on CUDA or the CPU."""

__version__ = "0.1.0"
