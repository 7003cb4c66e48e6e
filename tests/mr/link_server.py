"""One rank's memory link alone, under a file-descriptor limit, for tests/test_memory_stranger.py.

    python link_server.py ROOT RUN SECRET SPARE_FDS

Opens the run's node store in ROOT (token "tok", segment 0000000a), serves it with SECRET, then lowers its limit
of open files to what it has open plus SPARE_FDS, prints ``ADDRESS <host> <port>`` and serves until its standard input
closes. A traceback on its standard error fails the test.
"""
from __future__ import annotations

import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc.run.snapshots.memory_link import Link  # noqa: E402
from hvd_partialfc.run.snapshots.memory_store import NodeStore  # noqa: E402

root, run, secret, spare = sys.argv[1:5]
store = NodeStore(root, "tok", run, "0000000a")
store.open()
link = Link(store, secret, 0)
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + int(spare), hard))
print("ADDRESS", link.addr, link.port, flush=True)
sys.stdin.read()
