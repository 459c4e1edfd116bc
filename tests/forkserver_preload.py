"""A module for the ranks' fork server to preload (tests/test_launch_faults.py). On import it does what
FLOWLANE_TEST_PRELOAD says: ``exit`` (the fork server dies while importing it) or ``hang:<dir>`` (writes the
importing process's pid to <dir>/importing, then waits for <dir>/go, which the tests never write)."""

import os
import time
from pathlib import Path

_MODE = os.environ.get("FLOWLANE_TEST_PRELOAD", "")
if _MODE == "exit":
    os._exit(3)
if _MODE.startswith("hang:"):
    _DIR = Path(_MODE.removeprefix("hang:"))
    (_DIR / "importing").write_text(str(os.getpid()))
    while not (_DIR / "go").exists():
        time.sleep(0.05)
