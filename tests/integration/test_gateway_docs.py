"""The gateway's API page (``/docs``) against a real gateway process on a Redis of this
module's own: served from the gateway alone (Swagger UI's files from the installed package,
no CDN, no outbound connection), listing nothing without the token, and ``/openapi.json``
loadable the way the page loads it."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from producer.gateway.routes_docs import SCRIPT_URL, swagger_ui_dir
from tests.conftest import own_redis

pytestmark = pytest.mark.integration

# The page's own fetch (producer/gateway/routes_docs.py SCRIPT): Swagger UI's request with
# the interceptor's bearer header.
SWAGGER_ACCEPT = "application/json,*/*"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    with own_redis(tmp_path_factory, "gateway-docs") as st:
        st.start_gateway()
        try:
            yield st, st.s.gateway_token()
        finally:
            st.stop("gateway")


def get(st: Any, path: str, token: str | None = None, **headers: str) -> httpx.Response:
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.get(f"{st.gateway_url()}{path}", headers=headers, timeout=30.0)


def local_urls(page: str) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]*)"', page)


def remote_peers(pid: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The remote addresses of ``pid``'s TCP sockets (from /proc: its fds' socket inodes
    in the kernel's tables); unconnected sockets (listeners) have the unspecified one."""
    fds = f"/proc/{pid}/fd"
    links = (os.readlink(f"{fds}/{fd}") for fd in os.listdir(fds))
    inodes = {link[8:-1] for link in links if link.startswith("socket:[")}
    peers: set[Any] = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[9] not in inodes:
                    continue
                hexip = cols[2].split(":")[0]
                raw = b"".join(bytes.fromhex(hexip[i : i + 8])[::-1] for i in range(0, width, 8))
                ip = ipaddress.ip_address(raw)
                mapped = getattr(ip, "ipv4_mapped", None)
                peers.add(mapped or ip)
    return peers


def test_the_page_and_its_assets_come_from_the_gateway_alone(gw: tuple[Any, str]) -> None:
    """No token needed for the shell; every URL it names is the gateway's own, each one
    answers with the installed package's bytes, and the gateway connected to nothing but
    loopback meanwhile."""
    st, _ = gw
    page = get(st, "/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    head = httpx.head(
        f"{st.gateway_url()}/docs", timeout=30.0
    )  # a HEAD probe: GET's answer, no body
    assert head.status_code == 200 and head.content == b""
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp
    assert "script-src 'self';" in csp  # no inline or remote script
    assert "http:" not in page.text and "https:" not in page.text and "//" not in page.text
    urls = local_urls(page.text)
    assert sorted(urls) == sorted(
        [
            "/docs/assets/swagger-ui.css",
            "/docs/assets/favicon.png",
            "/docs/assets/swagger-ui-bundle.js",
            SCRIPT_URL,
        ]
    )
    script = get(st, SCRIPT_URL)
    assert script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    assert "http" not in script.text and '"/openapi.json"' in script.text
    assert "validatorUrl: null" in script.text  # Swagger UI's default validator is remote
    for url in urls:
        if url.startswith("/docs/assets/"):
            r = get(st, url)
            assert r.status_code == 200, url
            assert r.content == (swagger_ui_dir() / url.rsplit("/", 1)[1]).read_bytes()
    css = get(st, "/docs/assets/swagger-ui.css").headers["content-type"]
    assert css.startswith("text/css")
    pid = st._read_pid(st.pids / "gateway.pid")
    peers = remote_peers(pid)
    assert peers and all(p.is_loopback or p.is_unspecified for p in peers), peers


def test_the_page_lists_nothing_without_the_token(gw: tuple[Any, str]) -> None:
    """The shell names no route or model and holds no token: what it lists comes from
    /openapi.json, which answers 401 UNAUTHORIZED without the bearer token."""
    st, token = gw
    shell = get(st, "/docs").text + get(st, SCRIPT_URL).text
    assert token not in shell
    for name in ("/v2/models", "/v2/jobs", "infer", "minilm", "efficientnet"):
        assert name not in shell, name
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"}):
        r = get(st, "/openapi.json", **headers)
        assert r.status_code == 401, headers
        assert r.json()["code"] == "UNAUTHORIZED"
    # the page's assets carry the same no-secret bytes for a caller with a token
    assert get(st, "/docs", token).text == get(st, "/docs").text


def test_openapi_json_loads_as_the_page_loads_it(gw: tuple[Any, str]) -> None:
    """Swagger UI's fetch with the page's bearer header: the OIP routes and the jobs API,
    bearer security, and none of the page's own routes."""
    st, token = gw
    r = get(st, "/openapi.json", token, Accept=SWAGGER_ACCEPT)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    spec = r.json()
    assert spec["openapi"].startswith("3.")
    paths = spec["paths"]
    for path, method in [
        ("/v2", "get"),
        ("/v2/health/live", "get"),
        ("/v2/health/ready", "get"),
        ("/v2/models/{model}", "get"),
        ("/v2/models/{model}/ready", "get"),
        ("/v2/models/{model}/infer", "post"),
        ("/v2/models/{model}/versions/{version}/infer", "post"),
        ("/v2/jobs/{job_id}", "get"),
        ("/v2/jobs/{job_id}/events", "get"),
        ("/v2/jobs/{job_id}", "delete"),
    ]:
        assert method in paths.get(path, {}), (path, method, sorted(paths))
    assert not [p for p in paths if p.startswith("/docs") or p == "/openapi.json"]
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_an_asset_the_package_does_not_ship_is_a_coded_404(gw: tuple[Any, str]) -> None:
    st, _ = gw
    for path in ("/docs/assets/nope.js", "/docs/assets/%2e%2e/%2e%2e/app.py"):
        r = get(st, path)
        assert r.status_code == 404, path
        assert r.json()["code"] == "NOT_FOUND", path
