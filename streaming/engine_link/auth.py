"""The engine link's shared secret: the token a gateway sends in its HELLO and the engine checks before it says
anything else, the messages of a refusal on both sides, and the engine's rate-limited log of refusals. The token is
FISHGATE_ENGINE_TOKEN on both sides (server.settings reads it); this module reads no environment.

The token authenticates, it does not encrypt: across hosts the link belongs on a private network.
"""

from __future__ import annotations

import hmac
import logging
import time

log = logging.getLogger(__name__)

TOKEN_VARIABLE = "FISHGATE_ENGINE_TOKEN"
# What the engine answers a gateway whose token is wrong or missing (REFUSED), and what the gateway logs once.
REFUSED_TOKEN = "the engine refused this gateway's token (wrong or missing)"
REFUSED_FIX = f"set {TOKEN_VARIABLE} to the engine's token"
# The engine logs refusals at most this often (a gateway with the wrong token retries every second).
REFUSAL_LOG_INTERVAL_S = 60.0


def token_matches(expected: str | None, given: object) -> bool:
    """Whether a HELLO's `given` token admits a gateway: anything when the engine has no token, else an equal string
    (compared in constant time)."""
    if not expected:
        return True
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


class RefusalLog:
    """The engine's log of refused gateways: the first at once, then at most one line per REFUSAL_LOG_INTERVAL_S
    with how many were refused meanwhile."""

    def __init__(self) -> None:
        self.refused = 0  # since the process started
        self._logged_at = -float("inf")
        self._unlogged = 0

    def note(self, peer: str) -> None:
        self.refused += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at < REFUSAL_LOG_INTERVAL_S:
            return
        log.warning("refused %d connection(s) with a wrong or missing token (the last from %s): gateways need "
                    "%s set to this engine's token", self._unlogged, peer, TOKEN_VARIABLE)  # fmt: skip
        self._logged_at, self._unlogged = now, 0
