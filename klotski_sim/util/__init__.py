"""Small helpers every layer may use: errors, units, argument types, stop handling, progress, the host."""
