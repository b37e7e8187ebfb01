"""The gateway's exception tree. Every class has a machine-readable `code`; messages name the fix.

    FishgateError                      base; never raised itself
    ├── RequestError                   a client mistake; the session stays usable (HTTP 400 / error event)
    │   ├── TextTooLong                text beyond a documented limit
    │   ├── ValueOutOfRange            a parameter outside its accepted range
    │   ├── PromptTooLong              text + voice do not fit the model's context
    │   ├── UnsupportedLanguage        text in a script the served model cannot read (the English default voice)
    │   ├── UnknownVoice               reference id not found
    │   ├── IncompatibleVoice          reference codes this model cannot read (another codec's); the session closes
    │   └── BadReferenceAudio          uploaded reference is not usable audio
    ├── Overloaded                     capacity reached; retry later (HTTP 503 / close 1013)
    ├── SessionClosed                  the session was closed (client gone, stalled too long, shutdown)
    ├── NotReady                       the engine is warming up, draining or faulted (HTTP 503)
    │   └── EngineUnavailable          a resident engine process is not reachable; the gateway reconnects
    └── EngineFault                    an unexpected failure inside the engine; logged, reported as "internal error"

`server/` maps these to the wire in one place; `str(exc)` of an EngineFault never reaches a client.
"""

from __future__ import annotations


class FishgateError(Exception):
    code = "error"


class RequestError(FishgateError):
    code = "bad_request"


class TextTooLong(RequestError):
    code = "text_too_long"


class ValueOutOfRange(RequestError):
    code = "value_out_of_range"


class PromptTooLong(RequestError):
    code = "prompt_too_long"


class UnsupportedLanguage(RequestError):
    code = "unsupported_language"


class UnknownVoice(RequestError):
    code = "unknown_voice"


class IncompatibleVoice(RequestError):
    code = "incompatible_voice"


class BadReferenceAudio(RequestError):
    code = "bad_reference_audio"


class Overloaded(FishgateError):
    code = "overloaded"


class AdmissionDeferred(Overloaded):
    """Refused by the real-time admission (streaming.realtime_admission): a moment's state, so Engine.admit waits."""


class SessionClosed(FishgateError):
    code = "session_closed"


class NotReady(FishgateError):
    code = "not_ready"


class EngineUnavailable(NotReady):
    """The gateway's resident engine (`fishgate serve --engine`) cannot be reached: not started, restarting or
    dead. Sessions it held end with a fatal SessionError of this code; the gateway reconnects by itself."""

    code = "engine_unavailable"


class EngineFault(FishgateError):
    code = "internal_error"
