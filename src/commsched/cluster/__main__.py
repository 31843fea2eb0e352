"""`python -m commsched.cluster ...`: the same as `commsched-cluster ...`."""

import sys

from commsched.cluster.cli import main

sys.exit(main())
