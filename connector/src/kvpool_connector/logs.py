"""The connector's loggers: children of vLLM's "vllm" logger ("vllm.kvpool_connector.worker"), so their
lines go through the handler vLLM configures on "vllm", in vLLM's format (level, time, file:line, and
the "(EngineCore pid=N)" prefix of vLLM's processes), at VLLM_LOGGING_LEVEL, and follow a
VLLM_LOGGING_CONFIG_PATH that configures "vllm".

vllm.logger.init_logger(__name__) would not do that for a module outside vllm: it returns
logging.getLogger("kvpool_connector.worker"), which propagates to the root logger that vLLM leaves
unconfigured (warnings came out bare on stderr, info lines not at all). The *_once methods init_logger
adds are not used here (ratelimit.RateLimitedLog says what repeats), and importing vllm.logger would
make model_identity and request_inputs, which the key functions use, import all of vLLM."""

from __future__ import annotations

import logging

PARENT = "vllm"  # the logger vLLM configures (vllm.logger.DEFAULT_LOGGING_CONFIG)


def connector_logger(module: str) -> logging.Logger:
    """The logger of a connector module (pass __name__): vllm.<module>."""
    return logging.getLogger(f"{PARENT}.{module}")
