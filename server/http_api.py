"""HTTP synthesis and voice endpoints: fish-speech `POST /v1/tts`, OpenAI `POST /v1/audio/speech`, `/v1/references`.

`routes()` is what the app mounts. Each API lives in its own module (`fish_http`, `openai_http`,
`references_http`); what they share (guard, errors, bodies, audio responses) is `http_common`, and the synthesis
runner both synthesis APIs use is `synthesis`. docs/http-api.md describes the endpoints.
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from . import fish_http, openai_http, references_http


def routes() -> list[BaseRoute]:
    return [*fish_http.routes(), *openai_http.routes(), *references_http.routes()]
