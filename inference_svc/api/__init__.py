"""The inference service's doors: the gRPC handlers (server), the OpenAI-compatible HTTP door
and its JSON, and who may call what. Owns validation at the edge and status codes; may import
the engine, sessions, storage (slot save/restore), the shared types, and clientlib."""
