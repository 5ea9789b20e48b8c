"""The project's one base exception.

Every error a user can cause — a bad flag, file, field or configuration — is a `KlotskiError`
(a ValueError, so callers that catch ValueError keep working) and is shown by both CLIs as one
`error:` line with exit status 2. Anything else is a bug in klotski and shows its traceback.
"""

from __future__ import annotations


class KlotskiError(ValueError):
    """Something the user asked for cannot be done; the message names the flag, file or field."""


class UsageError(KlotskiError):
    """A value that is not allowed (a model, policy, option or size), refused before anything runs."""


class StorageRefusal(UsageError):
    """A configuration whose weights and KV cache the simulated machine's host memory or disk
    cannot hold (the message says which, with the numbers): a sweep records it as status
    `refused`, not as an `error`, which would read as a failure of the simulator."""


class MissingCapability(UsageError):
    """A configuration the simulated machine cannot run for what its profile lacks (a policy that
    computes on the CPU, on a profile without a `cpu:` section; measured op times of this model's
    ops): a sweep records it as status `refused`, as a storage shortfall is, not as an `error`."""


class MachineRefusal(UsageError):
    """A run larger than the memory of the machine running klotski (not the simulated one) can
    hold, refused after its first steps are built (klotski_sim.util.run_size): a sweep records it as
    status `too-large`."""
