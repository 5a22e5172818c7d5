"""The snapshot client: what an inference replica (or any other caller) imports to talk to the
snapshot service. It owns the Python side of the contract that both ends share (records, name
rules, wire codecs, digests, protocol constants) and may import only itself, the generated stubs
(`snapshot_svc.pb`) and the shared helpers (`snapshot_svc.clientlib`); the server imports it,
never the other way round."""

from snapshot_svc.client.snapshot_client import SnapshotClient

__all__ = ["SnapshotClient"]
