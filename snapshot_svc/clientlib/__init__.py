"""The gRPC plumbing the snapshot client library shares with both services.

Errors (one class per status code), the env-to-flag configuration, the JSON log
format, the status interceptor, API keys, TLS credentials, a directory fsync and the
allocator knobs each entry point sets for its own process.
These modules depend
on grpc and the standard library only, so the inference service, which already
depends on the snapshot client library, imports them without importing anything of
the snapshot server; the snapshot server and the deploy entry point use the same
copies.
"""
