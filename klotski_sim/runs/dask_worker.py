"""The setup of a Dask worker that runs sweep configurations (imported only where dask is)."""

from __future__ import annotations

from typing import Any

from distributed import WorkerPlugin


class SharesTheMachine(WorkerPlugin):
    """Sets each worker of a local cluster up as a local pool's worker (`runner.pool_worker`): its
    collector, and this machine's memory shared among `in_flight` runs. A plugin rather than one
    `client.run`, which reaches only the workers present at the start: one the nanny restarts after
    a run kills it would skip the setup and check its runs' memory as if it had the machine alone."""

    idempotent = True
    name = "klotski-shares-the-machine"

    def __init__(self, in_flight: int) -> None:
        self.in_flight = in_flight

    def setup(self, worker: Any) -> None:
        from klotski_sim.runs.runner import pool_worker

        pool_worker(self.in_flight)
