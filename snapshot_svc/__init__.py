"""snapshot_svc: the gRPC service that stores slot snapshots (a target file and
an optional `.drft` sidecar per name) for any number of inference replicas.

- `snapshot_svc.client`: the client package (what the inference service imports;
  it holds the contract's Python side and imports nothing else of this package).
- `python -m snapshot_svc`: the server (`snapshot_svc.server`).
- `python -m snapshot_svc.ctl`: a small command-line client.
"""
