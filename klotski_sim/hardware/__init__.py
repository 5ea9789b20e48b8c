"""Hardware profiles: what a machine's GPU, links, CPU and memory can do, every number sourced."""
