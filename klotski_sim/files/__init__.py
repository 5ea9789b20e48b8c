"""Reading and writing users' files safely: text, YAML, npz, memory-mapped arrays, output folders."""
