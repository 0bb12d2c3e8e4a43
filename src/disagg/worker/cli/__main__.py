"""`python -m disagg.worker.cli` is the `disagg` command (what `disagg up` and the tests spawn)."""

import sys

from disagg.worker.cli import main

sys.exit(main())
