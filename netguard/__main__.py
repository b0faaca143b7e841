import sys

from netguard.cli import main

sys.exit(main())
