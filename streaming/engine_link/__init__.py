"""The link between gateways and a resident engine process: one Unix-socket connection per gateway process, carrying
many sessions, multiplexed by the engine's session ids.

    gateway process                                         engine process (`fishgate engine --listen unix:PATH`)
    server/ ─► client.RemoteEngine ─┐                  ┌─► host.EngineHost ─► streaming.engine.Engine (worker)
               connection.Link,     ├── protocol.py ───┤   one _Connection per gateway: its sessions, their pumps
               its RemoteSessions   │  frames over a   └─  process.py: socket takeover, signals, drain, exit
    server/ ─► (another gateway) ───┘  Unix socket

`protocol.py` is Sans-I/O (frames and message codecs); `connection.py` (one link, gateway side), `client.py` (keeping
it linked) and `host.py` (the engine side) are thin asyncio layers over it; `process.py` runs the engine process. None
of them imports torch: a gateway attached to a resident engine starts without it, and the engine process claims its
socket path before the CLI builds the Engine. This package's `__init__` imports none of its modules.
"""
