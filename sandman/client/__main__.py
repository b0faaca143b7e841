"""`python3 -m sandman.client`: the command-line client (sandman/client/cli.py)."""

import sys

from sandman.client.cli import main

if __name__ == "__main__":  # importing every module of the package must run nothing
    sys.exit(main())
