"""Serving: continuous batching of requests under KV-cache pressure, and the engines that trade
expert residency against KV capacity (docs/serving.md)."""
