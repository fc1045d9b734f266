"""A CPU hog for supervision tests: one busy process that dies with the test process.

A test kills its hogs in `finally`, but a test process that is itself killed (a CI timeout,
Ctrl-C twice, SIGTERM) runs no `finally`; a plain `while True: pass` child would then spin on
a core for good and slow everything after it. This one checks its parent on every pass of
the loop and exits once it has been reparented.
"""
from __future__ import annotations

import subprocess
import sys

_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def cpu_hog() -> subprocess.Popen:
    """Start one process that keeps a core busy until it is killed or its parent dies."""
    return subprocess.Popen([sys.executable, "-c", _LOOP])
