"""Codecs for the data messages of Put and Get, without extra copies.

A data message (`PutRequest{chunk}` / `GetResponse{chunk}`) is field 2, bytes:
tag 0x12, a varint length, the data. Sending one through the generated
protobuf classes copies each chunk three times (bytes(view), into the message,
out of it); here a chunk is framed once and decoded as a memoryview into the
received buffer. Everything else (headers, responses) goes through protobuf,
and the bytes on the wire are ordinary protobuf either way: any gRPC client
(grpcurl, generated stubs) interoperates.

The server registers its handlers with `add_snapshot_servicer`; the client uses
`SnapshotStub`. Handlers and callers see a chunk as a memoryview (or bytes) and
any other message as its protobuf object.
"""

from __future__ import annotations

from typing import Any

import grpc

from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Snapshot"].full_name
_CHUNK_TAG = 0x12  # field 2 (chunk), wire type 2 (length-delimited): both messages


def _prefix(n: int) -> bytes:
    out = bytearray((_CHUNK_TAG,))
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_chunk(data: bytes | bytearray | memoryview) -> bytes:
    """The serialized message holding only `chunk = data` (one copy of data)."""
    return b"".join((_prefix(len(data)), data))


def decode_chunk(data: bytes) -> memoryview | None:
    """The chunk of a serialized message that holds a chunk and nothing else, as a
    view into `data`; None for any other message (parse it with protobuf)."""
    if len(data) < 2 or data[0] != _CHUNK_TAG:
        return None
    n = shift = 0
    i = 1
    while True:
        if i >= len(data) or shift > 56:
            return None
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    if i + n != len(data):
        return None
    return memoryview(data)[i:]


def _encode_data_message(msg: Any) -> bytes:
    if isinstance(msg, bytes | bytearray | memoryview):
        return encode_chunk(msg)
    return msg.SerializeToString()


def decode_put_request(data: bytes) -> memoryview | pb.PutRequest:
    chunk = decode_chunk(data)
    return chunk if chunk is not None else pb.PutRequest.FromString(data)


def decode_get_response(data: bytes) -> memoryview | pb.GetResponse:
    chunk = decode_chunk(data)
    return chunk if chunk is not None else pb.GetResponse.FromString(data)


def add_snapshot_servicer(servicer: pb_grpc.SnapshotServicer, server: grpc.Server) -> None:
    """Like the generated add_SnapshotServicer_to_server, with the chunk codecs:
    Put's handler receives chunks as memoryviews; Get's handler may yield bytes
    (sent as a chunk) or GetResponse messages."""
    def unary(fn: Any, req: Any, resp: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString)

    handlers = {
        "Hello": unary(servicer.Hello, pb.HelloRequest, pb.HelloResponse),
        "Put": grpc.stream_unary_rpc_method_handler(
            servicer.Put, request_deserializer=decode_put_request,
            response_serializer=pb.PutResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(
            servicer.Get, request_deserializer=pb.GetRequest.FromString,
            response_serializer=_encode_data_message),
        "Stat": unary(servicer.Stat, pb.StatRequest, pb.StatResponse),
        "List": unary(servicer.List, pb.ListRequest, pb.ListResponse),
        "Delete": unary(servicer.Delete, pb.DeleteRequest, pb.DeleteResponse),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class SnapshotStub(pb_grpc.SnapshotStub):
    """The generated stub, with Put accepting chunks as bytes or memoryviews and
    Get yielding chunks as memoryviews (headers stay protobuf messages)."""

    def __init__(self, channel: grpc.Channel) -> None:
        super().__init__(channel)
        self.Put = channel.stream_unary(
            f"/{SERVICE_NAME}/Put", request_serializer=_encode_data_message,
            response_deserializer=pb.PutResponse.FromString, _registered_method=True)
        self.Get = channel.unary_stream(
            f"/{SERVICE_NAME}/Get", request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=decode_get_response, _registered_method=True)
