"""klotski_sim: a discrete-event simulator of offloaded MoE inference schedules (torch-free)."""

__version__ = "0.1.0"
