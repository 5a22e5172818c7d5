"""Warmslot inference service: gRPC generation over slots backed by the decoding core."""

__version__ = "0.1.0"
