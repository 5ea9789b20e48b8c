"""Outputs a user reads: Chrome/Perfetto traces, tables, Gantt charts and figures."""
