"""HTTP synthesis and voice endpoints: fish-speech `POST /v1/tts`, OpenAI `POST /v1/audio/speech`, `/v1/references`.

(Endpoints are added here; `routes()` is what the app mounts.)
"""

from __future__ import annotations

from starlette.routing import BaseRoute


def routes() -> list[BaseRoute]:
    return []
