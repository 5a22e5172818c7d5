"""python -m snapshot_svc --data-dir DIR [--host H] [--port N] ... (see --help)."""

import sys

from snapshot_svc.memory import tune_malloc
from snapshot_svc.server import main

tune_malloc()
sys.exit(main())
