#!/bin/sh
# SeaweedFS for the compose `s3` profile: master, volume, filer and S3 gateway in one
# `weed server` on /data, with one S3 identity (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY,
# the same variables the snapshot services read).
#
#   seaweedfs.sh            start (ports from WEED_*_PORT, defaults as SeaweedFS's own)
#   seaweedfs.sh health     exit 0 iff the S3 gateway answers HTTP
set -eu
: "${WEED_IP:=seaweedfs}" "${WEED_BIND:=0.0.0.0}" "${WEED_S3_PORT:=8333}"
: "${WEED_MASTER_PORT:=9333}" "${WEED_VOLUME_PORT:=8080}" "${WEED_FILER_PORT:=8888}"
if [ "${1:-}" = health ]; then
  exec python3 -c "
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen('http://127.0.0.1:$WEED_S3_PORT/', timeout=3)
except urllib.error.HTTPError:
    pass  # 403 without credentials: the gateway is up
except OSError:
    sys.exit(1)"
fi
if [ -z "${AWS_ACCESS_KEY_ID:-}" ] || [ -z "${AWS_SECRET_ACCESS_KEY:-}" ]; then
  echo "seaweedfs: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the S3 identity)" >&2
  exit 1
fi
umask 077
printf '{"identities":[{"name":"warmslot","credentials":[{"accessKey":"%s","secretKey":"%s"}],"actions":["Admin","Read","Write","List","Tagging"]}]}\n' \
  "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" >/tmp/s3.json
exec weed server -dir=/data -ip="$WEED_IP" -ip.bind="$WEED_BIND" \
  -master.port="$WEED_MASTER_PORT" -master.port.grpc=$((WEED_MASTER_PORT + 10000)) \
  -volume.port="$WEED_VOLUME_PORT" -volume.port.grpc=$((WEED_VOLUME_PORT + 10000)) \
  -filer.port="$WEED_FILER_PORT" -filer.port.grpc=$((WEED_FILER_PORT + 10000)) \
  -s3 -s3.port="$WEED_S3_PORT" -s3.port.grpc=$((WEED_S3_PORT + 10000)) \
  -s3.config=/tmp/s3.json -s3.port.iceberg=0 -s3.port.lance=0 \
  -master.volumeSizeLimitMB="${WEED_VOLUME_SIZE_MB:-1024}" -volume.max=0 "$@"
