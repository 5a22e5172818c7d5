"""snapshot_svc: the gRPC service that stores slot snapshots (a target file and
an optional `.drft` sidecar per name) for any number of inference replicas.

- `snapshot_svc.client.SnapshotClient`: the client library (what the inference
  service uses).
- `python -m snapshot_svc`: the server (`snapshot_svc.server`).
- `python -m snapshot_svc.ctl`: a small command-line client.
"""

__version__ = "0.1.0"

PROTOCOL_MIN = 1  # target files only
PROTOCOL_MAX = 2  # target plus draft sidecar, paired commit
MAX_CHUNK_BYTES = 1 << 20  # largest data chunk in a Put or Get stream (1 MiB)
