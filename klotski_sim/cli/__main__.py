"""`python -m klotski_sim.cli`: the `klotski-sim` command."""

import sys

from klotski_sim.cli.main import main

sys.exit(main())
