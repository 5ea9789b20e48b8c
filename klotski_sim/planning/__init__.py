"""Choosing a run's shape before it runs: the planner's n and placement, probes."""
