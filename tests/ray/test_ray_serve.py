"""fishgate on Ray Serve (server/ray_serve.py): the application of deploy/ray/serve.yaml's builder, run by `serve.run` in
a local Ray this module starts (2 CPUs, as CI has), FISHGATE_RAY_ENGINES=2, the embedded default model on CPU.

Clients are the real `websockets` client at its defaults (permessage-deflate offered) and httpx, on the gateway replica's
own port (Serve's HTTP proxy is off, as deploy/ray/serve.yaml has it).
Tests run in file order on one cluster: a stored voice uploaded through the gateway speaks; live sessions spread over
both engine replicas; a killed engine replica's
sessions end with `engine_unavailable`, /readyz counts 1 of 2, new sessions go to the other and Ray Serve replaces
it; a redeploy with a changed engine setting drains the old engines (a running utterance finishes) while an open socket
goes on with its next turn. Every wait is bounded.
"""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from server.ray_serve import ENGINES_ENV, GATEWAYS_ENV, app_builder, settings_of, split_args  # noqa: E402
from server.settings import connections_for  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402
from tests.server.http_helpers import clip  # noqa: E402
from tests.server.live_client import LiveClient, LiveResult, open_live, speak  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SERVE_YAML = ROOT / "deploy" / "ray" / "serve.yaml"
APP = "fishgate"
READY_TIMEOUT_S = 180.0  # two engines loading on 2 shared cores, or a replacement's start
STATS_TIMEOUT_S = 10.0  # an engine's counters reach the gateway once a second
TURN_TIMEOUT_S = 60.0
TEXT = "Hello there, this is a sentence from a test of the Ray deployment."
LONG_TEXT = "A sentence that is long enough to keep the engine busy while something happens to it. " * 3


@dataclass
class Cluster:
    base_url: str
    app_args: dict[str, Any]

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http", "ws") + "/v1/tts/live"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=10)

    def poll(self, path: str) -> dict[str, Any]:
        """A JSON document for a polling loop: {} when it does not come (the loop's deadline bounds the retries; during
        a redeploy the port passes from the old gateway replica to the new one)."""
        try:
            return self.get(path).json()
        except (httpx.TransportError, ValueError):
            return {}

    def engines(self) -> list[dict[str, Any]]:
        return self.poll("/engines").get("engines", [])

    def ready_engines(self) -> int:
        return self.poll("/readyz").get("engines", {}).get("ready", 0)


def wait_for(check: Callable[[], Any], what: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


async def until(check: Callable[[], Any], what: str, timeout_s: float = STATS_TIMEOUT_S) -> Any:
    return await asyncio.to_thread(wait_for, check, what, timeout_s)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    temp_dir = tempfile.mkdtemp(prefix="fg-ray-")  # short: Ray's socket paths live under it
    port = free_port()
    app_args = {"references_dir": str(Path(temp_dir) / "references"), "port": port}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENGINES_ENV, "2")  # read by the builder, which runs here
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
        try:
            serve.start(proxy_location="Disabled")
            serve.run(app_builder(app_args), name=APP, route_prefix=None)
            handle = Cluster(f"http://127.0.0.1:{port}", app_args)
            wait_for(lambda: handle.ready_engines() == 2, "both engines never became ready", READY_TIMEOUT_S)
            yield handle
        finally:
            ray.shutdown()  # the whole local cluster, Serve's actors with it (serve.shutdown's drains add ~8 s)
            shutil.rmtree(temp_dir, ignore_errors=True)


def test_only_the_ray_module_imports_ray_and_nothing_imports_it() -> None:
    for package in ("server", "streaming", "model"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
            names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
            if path.name != "ray_serve.py":
                assert not {n for n in names if n.split(".")[0] == "ray" or n.endswith("ray_serve")}, path


def test_serve_yaml_names_the_builder() -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_YAML.read_text()))
    (app,) = config.applications
    module, name = app.import_path.split(":")
    assert (module, name) == ("server.ray_serve", "app_builder")
    assert {d.name for d in app.deployments} <= {"Gateway", "EngineReplica", "EngineDirectory"}


def test_the_args_are_fishgate_settings_refused_before_any_replica_starts() -> None:
    assert settings_of({"max_sessions": 6, "ws_compression": False, "api_key": ["a", "b"]}).api_key == ("a", "b")
    with pytest.raises(ValueError, match="'max_session' is not a fishgate setting"):
        settings_of({"max_session": 6})
    with pytest.raises(ValueError, match="--max-sessions must be at least 1"):
        app_builder({"max_sessions": 0})
    with pytest.raises(ValueError, match="gateways"):
        app_builder({"workers": 2})
    engine, gateway = split_args({"checkpoint": "/m", "profile": "throughput", "api_key": "k", "log_level": "info"})
    assert engine == {"checkpoint": "/m", "profile": "throughput", "log_level": "info"}
    assert gateway == {"api_key": "k", "log_level": "info"}


def test_a_gateways_connection_cap_is_fixed_at_build_time_only_when_given(monkeypatch) -> None:
    """Without --max-connections a gateway replica follows the pool's sessions at run time (checked on the cluster
    below): a count fixed here would go stale when a config's `num_replicas` or autoscaling changes either side."""
    for variable in (ENGINES_ENV, GATEWAYS_ENV):
        monkeypatch.delenv(variable, raising=False)
    gateway_args = app_builder({"max_sessions": 6, "engines": 3, "gateways": 2})._bound_deployment.init_args[2]
    assert "max_connections" not in gateway_args  # the Gateway's bind(directory, engines, args, token)
    given = app_builder({"max_sessions": 6, "max_connections": 40})._bound_deployment.init_args[2]
    assert given["max_connections"] == 40


def test_readyz_engines_and_metrics_name_both_replicas(cluster: Cluster) -> None:
    ready = cluster.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "state": "ready", "engines": {"ready": 2, "total": 2, "expected": 2}}
    rows = cluster.engines()
    # the one gateway replica's connection cap: room for both engines' sessions (it has the pool to itself)
    capacity = sum(r["capacity"] for r in rows)
    assert capacity > 0 and f'fishgate_connections{{what="cap"}} {float(connections_for(capacity))}' in (
        cluster.get("/metrics").text
    )
    assert sorted(r["rank"] for r in rows) == [0, 1] and len({r["pid"] for r in rows}) == 2
    assert all(r["state"] == "ready" and r["address"].startswith("tcp:") for r in rows)
    metrics = cluster.get("/metrics").text
    for row in rows:
        assert f'fishgate_engine_replica{{engine="{row["address"]}",what="ready"}} 1.0' in metrics
        labels = (f'engine="{row["address"]}",node="{row["node_ip"]}",pid="{row["pid"]}",rank="{row["rank"]}",'
                  f'replica="{row["replica_id"]}"')  # fmt: skip
        assert f"fishgate_engine_replica_info{{{labels}}} 1.0" in metrics


async def open_turns(cluster: Cluster, count: int, text: str) -> list[tuple[Any, LiveClient, LiveResult]]:
    """`count` live turns at once, each with its text flushed and its first audio in; the turns stay open."""

    async def one() -> tuple[Any, LiveClient, LiveResult]:
        ws = await open_live(cluster.ws_url).__aenter__()
        client = LiveClient(ws)
        await client.start()
        await client.send({"event": "text", "text": text})
        await client.send({"event": "flush"})
        result = await client.read_until(LiveResult(), ("audio", "finish"))
        assert result.of("audio"), result.events
        return ws, client, result

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def stop_all(turns: list[tuple[Any, LiveClient, LiveResult]]) -> None:
    for ws, client, result in turns:
        if not result.of("finish"):
            await client.send({"event": "stop"})
            await asyncio.wait_for(client.read_until(result), TURN_TIMEOUT_S)
        await ws.close()


def test_a_stored_voice_is_encoded_by_an_engine_and_speaks_live(cluster: Cluster) -> None:
    files = {"audio": ("clip.wav", clip(2.0), "audio/wav")}
    created = httpx.post(f"{cluster.base_url}/v1/references", data={"id": "narrator", "text": TEXT}, files=files,
                         timeout=TURN_TIMEOUT_S)  # fmt: skip
    assert created.status_code == 201 and created.json()["encoded"] is True, created.text
    assert (Path(cluster.app_args["references_dir"]) / "narrator" / "voice.json").is_file()
    assert [v["id"] for v in cluster.get("/v1/references").json()["references"]] == ["narrator"]
    result = asyncio.run(speak(cluster.ws_url, [TEXT], reference_id="narrator"))
    assert result.error_codes == [] and len(result.audio) > 0


def streams_on_both(cluster: Cluster) -> list[dict[str, Any]] | None:
    rows = cluster.engines()
    return rows if len(rows) == 2 and all(r["streams"] >= 1 for r in rows) else None


def test_live_sessions_spread_over_both_engines_and_finish_with_audio(cluster: Cluster) -> None:
    async def run() -> list[LiveResult]:
        turns = await open_turns(cluster, 4, TEXT)
        try:
            await until(lambda: streams_on_both(cluster), "the sessions did not spread over both engines")
        finally:
            await stop_all(turns)
        return [result for _, _, result in turns]

    for result in asyncio.run(run()):
        assert result.error_codes == [] and result.events[-1] == {"event": "finish", "reason": "stop"}
        assert len(result.audio) > 0


def test_a_killed_engine_ends_its_sessions_the_other_serves_and_ray_replaces_it(cluster: Cluster) -> None:
    async def run() -> tuple[int, list[LiveResult], LiveResult]:
        turns = await open_turns(cluster, 4, TEXT)
        try:
            rows = await until(lambda: streams_on_both(cluster), "the sessions did not spread over both engines")
            victim = rows[0]
            os.kill(victim["pid"], signal.SIGKILL)
            # its sessions end at once; the other engine's go on
            ended = await asyncio.gather(
                *(asyncio.wait_for(c.read_until(r), timeout=2.0) for _, c, r in turns), return_exceptions=True
            )
            assert 0 < sum(isinstance(e, LiveResult) for e in ended) < len(turns), ended
            counts = await until(
                lambda: (body := cluster.poll("/readyz")).get("engines", {}).get("ready") == 1 and body,
                "/readyz never counted one engine ready",
            )
            assert counts["ready"] is True and counts["engines"]["expected"] == 2, counts
            fresh = await speak(cluster.ws_url, [TEXT])  # a new session goes to the healthy engine
            # a socket whose turn the dead engine ended takes the next turn (on the healthy engine)
            _, client, _ = next(t for t, e in zip(turns, ended, strict=True) if isinstance(e, LiveResult))
            next_turn = LiveResult()
            await client.start()
            await client.send({"event": "text", "text": TEXT})
            await client.send({"event": "stop"})
            await asyncio.wait_for(client.read_until(next_turn), TURN_TIMEOUT_S)
            assert next_turn.error_codes == [] and len(next_turn.audio) > 0, next_turn.events
        finally:
            await stop_all(turns)
        return victim["pid"], [r for _, _, r in turns], fresh

    victim_pid, results, fresh = asyncio.run(run())
    killed = [r for r in results if r.error_codes]
    assert killed and all(r.error_codes == ["engine_unavailable"] for r in killed)
    assert all(r.events[-1] == {"event": "finish", "reason": "error"} for r in killed)
    for r in results:
        if not r.error_codes:
            assert r.events[-1] == {"event": "finish", "reason": "stop"} and len(r.audio) > 0
    assert fresh.error_codes == [] and len(fresh.audio) > 0

    # the replacement is ready and linked, the dead one's entry expired (its link stays down)
    wait_for(
        lambda: [r["ready"] for r in cluster.engines()] == [True, True],
        "Ray Serve never replaced the killed engine",
        READY_TIMEOUT_S,
    )
    assert cluster.get("/readyz").json()["engines"] == {"ready": 2, "total": 2, "expected": 2}
    assert victim_pid not in {r["pid"] for r in cluster.engines()}
    again = asyncio.run(speak(cluster.ws_url, [TEXT]))
    assert again.error_codes == [] and len(again.audio) > 0


def test_a_redeploy_drains_the_old_replicas_then_closes_with_a_reason_and_a_reconnect_speaks(cluster: Cluster) -> None:
    before = {r["replica_id"] for r in cluster.engines()}
    # new args: Serve replaces every replica of the app, the new ones first (the gateways share the port meanwhile);
    # the old ones drain: the running turn finishes, then the old gateway closes its sockets with 1012 and a reason
    changed = {**cluster.app_args, "max_sessions": 6}
    redeployed = threading.Event()
    errors: list[BaseException] = []

    def redeploy() -> None:
        try:
            with pytest.MonkeyPatch.context() as env:
                env.setenv(ENGINES_ENV, "2")
                serve.run(app_builder(changed), name=APP, route_prefix=None)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)
        finally:
            redeployed.set()

    async def run() -> tuple[LiveResult, LiveResult, LiveResult]:
        (ws, client, result), *_ = await open_turns(cluster, 1, LONG_TEXT)
        thread = threading.Thread(target=redeploy, daemon=True)
        thread.start()
        try:
            await until(
                lambda: any(r["streams"] and r["state"] == "draining" for r in cluster.engines()),
                "the engine holding the turn never drained",
                READY_TIMEOUT_S,
            )
            await client.send({"event": "text", "text": TEXT})  # the running turn goes on during the drain
            await client.send({"event": "stop"})
            await asyncio.wait_for(client.read_until(result), TURN_TIMEOUT_S)
            closed = await asyncio.wait_for(client.read_until(LiveResult(), kinds=()), READY_TIMEOUT_S)
        finally:
            await ws.close()
        await until(lambda: redeployed.is_set() or None, "the redeploy never finished", READY_TIMEOUT_S)
        again = await speak(cluster.ws_url, [TEXT])  # a client that reconnects gets the new replicas
        return result, closed, again

    result, closed, again = asyncio.run(run())
    assert not errors, errors
    assert result.error_codes == [] and result.events[-1] == {"event": "finish", "reason": "stop"}
    assert closed.server_closed and closed.close_code == 1012 and "reconnect" in closed.close_reason, closed
    assert again.error_codes == [] and len(again.audio) > 0
    # the new engines registered once ready; the gateway links them within a poll and a handshake
    rows = wait_for(
        lambda: len(rows := [r for r in cluster.engines() if r["ready"]]) == 2 and rows,
        "the redeployed engines never both served",
        STATS_TIMEOUT_S,
    )
    assert not before & {r["replica_id"] for r in rows} and all(r["capacity"] == 6 for r in rows)
