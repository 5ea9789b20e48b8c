"""Running configurations: one run, sweeps over many (pool or Dask), the optimizer."""
