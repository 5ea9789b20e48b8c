"""What is run: model shapes, routing, traces (recorded, synthesised, cached) and their statistics."""
