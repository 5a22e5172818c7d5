"""The S3 API as the snapshot service uses it: where (`s3://bucket/prefix`), a boto3
client, and the status code of a failed call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import boto3
import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, NoCredentialsError
from botocore.exceptions import ConnectionError as BotoConnectionError

from snapshot_svc.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    SnapshotError,
    Unavailable,
)

_MISSING = ("NoSuchKey", "NoSuchUpload", "404", "NotFound")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending with "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """`s3://bucket` or `s3://bucket/prefix` (InvalidArgument otherwise)."""
        u = urlparse(url)
        if u.scheme != "s3" or not u.netloc or u.query or u.fragment:
            raise InvalidArgument(f"--store must be s3://bucket[/prefix], got {url!r}")
        prefix = u.path.strip("/")
        return cls(u.netloc, prefix + "/" if prefix else "")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def s3_error(what: str, exc: Exception) -> SnapshotError:
    """The status code of a failed S3 call: the store unreachable or overloaded is
    UNAVAILABLE (the client retries), refused credentials FAILED_PRECONDITION, a
    full store RESOURCE_EXHAUSTED, anything else INTERNAL."""
    if isinstance(exc, SnapshotError):
        return exc
    if isinstance(exc, BotoConnectionError | HTTPClientError):
        return Unavailable(f"{what}: the object store is unreachable ({exc})")
    if isinstance(exc, NoCredentialsError):
        return FailedPrecondition(f"{what}: no S3 credentials ({exc})")
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        detail = f"{code or status}: {err.get('Message', '')}".rstrip(": ")
        if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId",
                                            "SignatureDoesNotMatch"):
            return FailedPrecondition(f"{what}: the object store refused the credentials "
                                      f"({detail})")
        if status == 503 or status >= 500 or code in ("SlowDown", "ServiceUnavailable"):
            return Unavailable(f"{what}: the object store failed ({detail})")
        if code in ("EntityTooLarge", "QuotaExceeded"):
            return ResourceExhausted(f"{what}: {detail}")
        return Internal(f"{what}: {detail}")
    if isinstance(exc, BotoCoreError):
        return Internal(f"{what}: {exc}")
    return Internal(f"{what}: {exc!r}")


def is_missing(exc: Exception) -> bool:
    return isinstance(exc, ClientError) and str(
        exc.response.get("Error", {}).get("Code", "")) in _MISSING


def make_client(endpoint: str, region: str, workers: int) -> Any:
    """A boto3 S3 client with the standard credential chain (AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY, AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE...) minus the EC2
    instance metadata lookup (a network call to a link-local address on every start
    without credentials)."""
    session = botocore.session.get_session()
    session.get_component("credential_provider").remove("iam-role")
    config = Config(connect_timeout=5, read_timeout=60,
                    retries={"max_attempts": 3, "mode": "standard"},
                    max_pool_connections=max(10, 2 * workers),
                    s3={"addressing_style": "path"},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    client = boto3.Session(botocore_session=session).client(
        "s3", endpoint_url=endpoint or None, region_name=region or "us-east-1", config=config)
    for op in ("PutObject", "UploadPart"):
        client.meta.events.register(f"before-sign.s3.{op}", _unsigned_payload)
    return client


def _unsigned_payload(request: Any, **_: Any) -> None:
    """Object bodies are not hashed for the signature (what boto3 does over https
    anyway; over http it would hash every byte once more, and the store again to check
    it): the service checks each part's SHA-256 before it completes the upload and
    again on every Get."""
    request.headers["X-Amz-Content-SHA256"] = "UNSIGNED-PAYLOAD"
