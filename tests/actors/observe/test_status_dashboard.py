"""``erlay status --address http://HEAD:8265``: from a Ray dashboard URL to the GCS.

The decisions (which URL, which reply is a Ray dashboard's, which GCS address it names) are
checked on hand-made replies shaped as Ray 2.60's; the HTTP shell and the command against
small fake servers on loopback, with wrong answers planted.  No Ray here: the real
dashboard is in test_status_cluster.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from erlay.actors.observe.dashboard import (
    DashboardError,
    dashboard_base,
    gcs_candidates,
    head_gcs_address,
    http_failure,
    is_dashboard_url,
    locate_gcs,
    ray_version,
)
from erlay.actors.observe.status import cli_status
from tests.actors.observe.test_status import free_port, status_args

VERSION = {"version": "4", "ray_version": "2.60.0", "ray_commit": "b7f4259e",
           "session_name": "session_2026-12-05_04-21-18_020531_7614"}


def node(ip: str, head: bool, gcs: str | None) -> dict[str, Any]:
    """One entry of ``GET /nodes?view=summary`` as Ray 2.60 answers it (the parts read)."""
    cmdline = ["/venv/ray/core/src/ray/raylet/raylet", f"--node_ip_address={ip}",
               f"--python_worker_command=python default_worker.py --gcs-address={gcs}"
               if gcs else "--python_worker_command=python default_worker.py"]
    if gcs:
        cmdline.append(f"--gcs-address={gcs}")
    return {"hostname": ip, "ip": ip, "cmdline": cmdline,
            "raylet": {"nodeManagerAddress": ip, "isHeadNode": head, "state": "ALIVE"}}


def summary(*nodes: dict[str, Any]) -> bytes:
    return json.dumps({"result": True, "msg": "Node summary fetched.",
                       "data": {"summary": list(nodes)}}).encode()


# ------------------------------------------------------------------ the pure core

def test_http_and_https_name_a_dashboard_and_anything_else_a_gcs() -> None:
    assert is_dashboard_url("http://10.0.0.5:8265") and is_dashboard_url("HTTPS://ray.corp")
    assert not any(map(is_dashboard_url, ["10.0.0.5:6379", "auto", "ray://head:10001"]))


def test_a_dashboard_url_keeps_its_proxy_prefix_and_drops_a_trailing_slash() -> None:
    assert dashboard_base("http://127.0.0.1:8265/") == "http://127.0.0.1:8265"
    assert dashboard_base(" HTTPS://ray.corp/team-a/ray/ ") == "https://ray.corp/team-a/ray"


@pytest.mark.parametrize("url", ["http://", "http://:8265", "http://head:port",
                                 "http://head:0", "ftp://head:8265"])
def test_a_url_without_a_host_or_with_a_bad_port_is_refused(url: str) -> None:
    with pytest.raises(DashboardError, match=url.replace("/", ".")):
        dashboard_base(url)


def test_a_ray_dashboard_names_its_ray_version() -> None:
    assert ray_version(json.dumps(VERSION).encode()) == "2.60.0"


@pytest.mark.parametrize("reply", [b"<html>Welcome to nginx</html>", b'{"version": "4"}',
                                   b'["2.60.0"]', b'{"ray_version": 2}'])
def test_a_version_reply_without_ray_version_is_not_a_ray_dashboard(reply: bytes) -> None:
    with pytest.raises(DashboardError, match=r"^not a Ray dashboard: GET /api/version"):
        ray_version(reply)


def test_the_gcs_is_read_from_the_head_nodes_command_line_not_a_workers() -> None:
    reply = summary(node("10.0.0.7", False, "10.0.0.5:6379"),
                    node("10.0.0.5", True, "10.0.0.5:6380"))
    assert head_gcs_address(reply) == "10.0.0.5:6380"


def test_a_head_without_the_gcs_flag_is_a_clear_error_naming_the_way_out() -> None:
    """Planted: the head's command line lacks --gcs-address (the flag inside the worker
    command does not count), or is missing (the agent has not reported it yet)."""
    bare = node("10.0.0.5", True, None)
    for reply in (summary(bare), summary({**bare, "cmdline": []}),
                  summary({k: v for k, v in bare.items() if k != "cmdline"})):
        with pytest.raises(DashboardError) as err:
            head_gcs_address(reply, "2.60.0")
        assert str(err.value) == (
            "the Ray dashboard (Ray 2.60.0) does not name its GCS (no --gcs-address in its "
            "head node's command line); give --address HEAD:6379")


@pytest.mark.parametrize("reply, message", [
    (summary(node("10.0.0.7", False, "10.0.0.5:6379")), "lists no head node"),
    (summary(), "lists no head node"),
    (b'{"result": true, "data": {}}', "^not a Ray dashboard: GET /nodes.* no node summary"),
    (b'{"detail": "Not Found"}', "^not a Ray dashboard: GET /nodes.* no node summary"),
    (b"not json", "^not a Ray dashboard: GET /nodes.* no JSON"),
])
def test_a_summary_without_a_head_node_is_refused(reply: bytes, message: str) -> None:
    with pytest.raises(DashboardError, match=message):
        head_gcs_address(reply)


def test_the_dashboards_own_host_is_tried_before_the_heads_word() -> None:
    assert gcs_candidates("http://localhost:8265", "10.244.1.5:6379") == (
        "localhost:6379", "10.244.1.5:6379")
    assert gcs_candidates("http://10.0.0.5:8265", "10.0.0.5:6379") == ("10.0.0.5:6379",)
    assert gcs_candidates("http://[::1]:8265", "10.0.0.5:6379") == (
        "[::1]:6379", "10.0.0.5:6379")


def test_http_statuses_say_token_or_not_a_dashboard() -> None:
    assert "RAY_AUTH_MODE=token" in str(http_failure("/api/version", 401))
    assert "refused the token" in str(http_failure("/nodes?view=summary", 403))
    assert str(http_failure("/api/version", 404)).startswith("not a Ray dashboard")
    assert str(http_failure("/nodes?view=summary", 500)) == (
        "the Ray dashboard answered GET /nodes?view=summary with HTTP 500")


# ---------------------------------------------------- the shell, on fake servers

Route = Callable[[BaseHTTPRequestHandler], tuple[int, bytes] | None]  # None: answered


@pytest.fixture
def serve() -> Iterator[Callable[[dict[str, Route]], str]]:
    """Start a loopback HTTP server answering ``routes`` (path -> handler); its base URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(routes: dict[str, Route]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path)
                reply = route(self) if route else (404, b"404: Not Found")
                if reply is None:
                    return
                status, body = reply
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def answer(body: bytes, status: int = 200) -> Route:
    return lambda _request: (status, body)


def fake_dashboard(gcs: str, token: str | None = None) -> dict[str, Route]:
    def guarded(body: bytes) -> Route:
        def route(request: BaseHTTPRequestHandler) -> tuple[int, bytes]:
            if token and request.headers.get("Authorization") != f"Bearer {token}":
                return 401, b"Unauthorized: Missing authentication token"
            return 200, body
        return route
    return {"/api/version": guarded(json.dumps(VERSION).encode()),
            "/nodes?view=summary": guarded(summary(node("127.0.0.1", True, gcs)))}


def test_a_dashboard_leads_to_its_gcs_with_the_token_sent(
        serve: Callable[[dict[str, Route]], str]) -> None:
    base = serve(fake_dashboard("10.0.0.5:41234", token="s3cret"))
    with pytest.raises(DashboardError, match=r"HTTP 401.*RAY_AUTH_MODE=token"):
        locate_gcs(base, {})
    assert locate_gcs(base, {"Authorization": "Bearer s3cret"}) == (
        "127.0.0.1:41234", "10.0.0.5:41234")


def test_a_dashboard_that_trickles_its_answer_is_cut_off_at_the_deadline(
        serve: Callable[[dict[str, Route]], str]) -> None:
    def trickle(request: BaseHTTPRequestHandler) -> None:
        request.send_response(200)
        request.send_header("Content-Length", "100")
        request.end_headers()
        try:
            for _ in range(100):  # a byte every 0.1 s: each read is quick, the whole is not
                request.wfile.write(b" ")
                request.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass  # the client gave up
    base = serve({"/api/version": trickle})
    with pytest.raises(DashboardError, match=r"does not answer: no whole answer within 0\.5 s"):
        locate_gcs(base, {}, timeout_s=0.5)


@pytest.fixture
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep Ray's loopback token hook from switching this process to token mode."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def run_cli(address: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = cli_status(status_args(address))
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err.splitlines()


def test_cli_a_dashboard_url_nothing_answers_at_is_one_line_and_exit_1(
        no_token_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, err = run_cli(url, capsys)
    assert code == 1
    assert len(err) == 1 and err[0].startswith(
        f"erlay: no running erlay job found at {url} (the Ray dashboard does not answer: ")


def test_cli_a_server_that_is_not_a_ray_dashboard_is_one_line_and_exit_1(
        serve: Callable[[dict[str, Route]], str], no_token_env: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    base = serve({"/api/version": answer(b"<html>Welcome to nginx</html>")})
    assert run_cli(base, capsys) == (1, [
        f"erlay: no running erlay job found at {base} (not a Ray dashboard: GET /api/version "
        "answered no JSON)"])
    base = serve({})  # 404 everywhere
    assert run_cli(base + "/", capsys) == (1, [
        f"erlay: no running erlay job found at {base}/ (not a Ray dashboard: GET /api/version "
        "answered HTTP 404)"])


def test_cli_a_dashboard_without_the_gcs_field_is_one_line_and_exit_1(
        serve: Callable[[dict[str, Route]], str], no_token_env: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    base = serve({**fake_dashboard("unused:1"),
                  "/nodes?view=summary": answer(summary(node("127.0.0.1", True, None)))})
    code, err = run_cli(base, capsys)
    assert code == 1 and len(err) == 1
    assert "(the Ray dashboard (Ray 2.60.0) does not name its GCS" in err[0]


def test_cli_a_gcs_the_dashboard_names_but_nothing_listens_at_is_exit_1(
        serve: Callable[[dict[str, Route]], str], no_token_env: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    base = serve(fake_dashboard(f"127.0.0.1:{port}"))
    assert run_cli(base, capsys) == (1, [
        f"erlay: no running erlay job found at 127.0.0.1:{port} (dashboard {base}) "
        "(nothing listens there)"])
