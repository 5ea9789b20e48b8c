"""The `klotski-sim` command line."""
