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
from snapshot_svc.memory import INFERENCE_THRESHOLDS, tune_malloc


class StopDuringStartup(BaseException):  # like KeyboardInterrupt: not swallowed
    """SIGTERM / SIGINT arrived before the service was serving."""


def main(argv: list[str] | None = None) -> int:
    cfg = config.from_args(sys.argv[1:] if argv is None else argv)
    tune_malloc(*INFERENCE_THRESHOLDS)  # large requests' memory returns when they end
    logger = log.setup(cfg.log_level, cfg.log_format)
    from inference_svc.core import CoreError

    try:
        cfg.check_models()  # before the server's imports: a bad model file fails at once
    except (CoreError, OSError) as exc:
        logger.error("cannot start", extra=log.fields(error=str(exc)))
        return 1
    from inference_svc.server import Server

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
