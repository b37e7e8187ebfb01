"""The link between gateways and resident engine processes: one connection (a Unix socket, or TCP with a shared
token) per gateway process and engine, carrying many sessions, multiplexed by the engine's session ids.

    gateway process                                         engine process (`fishgate engine --listen ADDRESS`)
    server/ ─► client.RemoteEngine ─┐                  ┌─► host.EngineHost ─► streaming.engine.Engine (worker)
               connection.Link,     ├── protocol.py ───┤   one _Connection per gateway: its sessions, their pumps
               its RemoteSessions   │  frames over a   └─  service.py: start, drain, close; process.py: signals, exit
    server/ ─► (another gateway) ───┘  Unix socket or TCP
    server/ ─► pool.EnginePool ─► one RemoteEngine per engine (--engine A,B,…): sessions by headroom (routing.py)

`protocol.py` is Sans-I/O (frames and message codecs), `address.py`, `auth.py` and `routing.py` are pure;
`connection.py` (one link, gateway side), `client.py` (keeping it linked), `pool.py` (several engines) and `host.py`
(the engine side) are thin asyncio layers over them; `sockets.py` claims the listening socket, `service.py` runs an
engine's life on it (start, drain, close) and `process.py` runs the engine process. None of them imports torch: a
gateway attached to a resident engine starts without it, and the engine process claims its address before the CLI
builds the Engine. This package's `__init__` imports none of its modules.
"""
