"""The one place where errors become wire messages: WebSocket close codes, error events and HTTP statuses.

A recoverable client mistake becomes an error event (or HTTP 4xx) with a message that names the fix; protocol
violations close with the matching code; anything unexpected is logged by the caller and reported as
"internal error" — `str(exc)` of an unexpected exception never reaches a client.
"""

from __future__ import annotations

from dataclasses import dataclass

from streaming.audio_in import ReferenceAudioError
from streaming.audio_out import AudioFormatError
from streaming.errors import (
    FishgateError,
    NotReady,
    Overloaded,
    RequestError,
    SessionClosed,
    UnknownVoice,
)

# WebSocket close codes (RFC 6455 §7.4.1 and the IANA registry)
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED_DATA = 1003  # wrong frame type
CLOSE_INVALID_PAYLOAD = 1007  # not msgpack / JSON / UTF-8
CLOSE_POLICY = 1008  # auth, origin, limits, a client that does not read
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_SERVICE_RESTART = 1012
CLOSE_TRY_AGAIN_LATER = 1013  # overloaded

INTERNAL_MESSAGE = "internal error"


@dataclass(frozen=True, slots=True)
class WireError:
    code: str  # machine-readable
    message: str  # names the fix
    http_status: int


class ProtocolViolation(Exception):
    """The client broke the protocol: error event, finish(error), then close with `close_code`."""

    def __init__(self, code: str, message: str, close_code: int) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.close_code = close_code


# gateway-level refusals (defined in server.gateway) by code → HTTP status
GATEWAY_STATUS = {"unauthorized": 401, "forbidden_origin": 403, "forbidden_host": 403, "rate_limited": 429}


def to_wire(exc: BaseException) -> WireError:  # noqa: PLR0911 - one branch per family reads best
    """Map a known exception to (code, message, HTTP status); unknown ones to a generic internal error."""
    if isinstance(exc, FishgateError) and exc.code in GATEWAY_STATUS:
        return WireError(exc.code, str(exc), GATEWAY_STATUS[exc.code])
    if isinstance(exc, UnknownVoice):
        return WireError(exc.code, str(exc), 404)
    if isinstance(exc, RequestError):
        return WireError(exc.code, str(exc), 400)
    if isinstance(exc, AudioFormatError | ReferenceAudioError):
        return WireError(exc.code, str(exc), 400)
    if isinstance(exc, Overloaded):
        return WireError(exc.code, str(exc), 503)
    if isinstance(exc, NotReady):
        return WireError(exc.code, str(exc), 503)
    if isinstance(exc, SessionClosed):
        return WireError(exc.code, str(exc), 409)
    if isinstance(exc, FishgateError) and exc.code not in ("internal_error", "error"):
        return WireError(exc.code, str(exc), 500)
    return WireError("internal_error", INTERNAL_MESSAGE, 500)


def is_known(exc: BaseException) -> bool:
    return to_wire(exc).code != "internal_error"
