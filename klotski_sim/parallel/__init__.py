"""Many GPUs: collective costs over a machine's fabric, expert placement and replication across
ranks, token-to-rank grouping, and what expert or tensor parallelism costs a model's decode step."""
