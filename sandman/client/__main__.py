"""`python3 -m sandman.client`: the command-line client (sandman/client/cli.py)."""

import sys

from sandman.client.cli import main

sys.exit(main())
