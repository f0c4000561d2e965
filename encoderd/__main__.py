"""`python -m encoderd ...` runs the `encoderd` command (where its script is not on PATH)."""

import sys

from .server.main.cli import main

sys.exit(main())
