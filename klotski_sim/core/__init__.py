"""The contracts and the simulator: Schedule (what to run), cost model, event engine, Timeline (what happened)."""
