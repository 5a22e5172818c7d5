"""python -m snapshot_svc --data-dir DIR [--host H] [--port N] ... (see --help)."""

import sys

from snapshot_svc.server import main

sys.exit(main())
