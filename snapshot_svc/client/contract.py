"""The snapshot protocol's constants, one definition shared by the client and the server."""

VERSION = "0.1.0"  # reported in Hello by both sides
PROTOCOL_MIN = 1  # target files only
PROTOCOL_MAX = 2  # target plus draft sidecar, paired commit
MAX_CHUNK_BYTES = 1 << 20  # largest data chunk in a Put or Get stream (1 MiB)
