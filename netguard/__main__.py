"""`python3 -m netguard ...`, and the guard's init container: `python3 -I -S
/opt/sandman/netguard.py apply ...`, where that path is a link to this file (images/Dockerfile).

Every guarded pod's start waits on the guard under the pod's own CPU quota. Run as a file it
pays neither runpy (the -m machinery: importlib.util, contextlib) nor site (.pth files, user
site): the only path it adds is the directory holding this package, and -I keeps PYTHON*
variables and the script's own directory out of a root process with NET_ADMIN.
"""

import os
import sys

if not __package__:  # run as a file: -I put no directory of ours on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from netguard.cli import main  # noqa: E402

rc = main()
# Skip the interpreter's teardown (module and garbage finalisation, ~2 ms of CPU): the status
# file is written and closed by then, and the streams are flushed here (a flush that fails
# raises, and the normal exit reports it).
sys.stdout.flush()
sys.stderr.flush()
os._exit(rc)
