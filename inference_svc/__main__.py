"""`python -m inference_svc`: runs the inference service until SIGTERM / SIGINT.

    python -m inference_svc --model models/target.gguf --draft models/draft.gguf \\
        --slots 4 --port 50051 --slot-save-path var/slots
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

from inference_svc import config, log
from snapshot_svc.clientlib import malloc

# glibc malloc: a request of a few MiB of text (its message, string, token ids and
# response) is mapped and unmapped on its own, and an arena keeps at most a few MiB of
# free top, so the memory of large requests goes back to the kernel when they end
# (this overrides the image's GLIBC_TUNABLES for this process)
MMAP_THRESHOLD_BYTES = 2 << 20
TRIM_THRESHOLD_BYTES = 4 << 20


class StopDuringStartup(BaseException):  # like KeyboardInterrupt: not swallowed
    """SIGTERM / SIGINT arrived before the service was serving."""


def main(argv: list[str] | None = None) -> int:
    cfg = config.from_args(sys.argv[1:] if argv is None else argv)
    malloc.set_thresholds(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)
    logger = log.setup(cfg.log_level, cfg.log_format)
    from inference_svc.core import CoreError

    try:
        cfg.check_models()  # before the server's imports: a bad model file fails at once
    except (CoreError, OSError) as exc:
        logger.error("cannot start", extra=log.fields(error=str(exc)))
        return 1
    from inference_svc.api.server import Server

    stop = threading.Event()
    starting = [True]

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal", extra=log.fields(signal=signal.Signals(signum).name))
        stop.set()
        if starting[0]:  # loading models or waiting for the store: stop now, not after
            raise StopDuringStartup(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        srv = Server(cfg)
    except ValueError as exc:  # an unreadable or wrong key file
        logger.error("cannot start", extra=log.fields(error=str(exc)))
        return 1
    signal.signal(signal.SIGHUP, lambda signum, frame: srv.reload_keys())
    try:
        srv.start()
        srv.load()
        starting[0] = False
    except StopDuringStartup as exc:
        starting[0] = False
        logger.info("stopped during start-up", extra=log.fields(signal=str(exc)))
        return 0 if srv.stop(0) else 1
    except (CoreError, OSError, ValueError) as exc:
        starting[0] = False
        srv.stop(0)
        logger.error("cannot start", extra=log.fields(error=str(exc)))  # the last line
        return 1
    while not stop.wait(1.0):
        pass
    return 0 if srv.stop() else 1


if __name__ == "__main__":
    sys.exit(main())
