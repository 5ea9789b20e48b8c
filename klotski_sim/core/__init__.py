"""The contracts and the simulator: Schedule (what to run), cost model, SimPy engine, Timeline (what happened)."""
