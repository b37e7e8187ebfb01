"""fishgate's gateway: Starlette app, WebSocket and HTTP endpoints, wire protocols, settings, CLI, metrics.
Never imports torch or `model/` (the CLI entry may call `streaming`'s public API)."""
