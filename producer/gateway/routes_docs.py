"""The gateway's browsable API page: Swagger UI over ``/openapi.json``, with no internet.

Routes::

    GET /docs                the page: a token box and Swagger UI (public)
    GET /docs/init.js        the page's script (public)
    GET /docs/assets/{file}  Swagger UI's JS and CSS (public)

Swagger UI's files come from the ``fastapi-offline`` package (a dependency of the product:
the Swagger UI 5 dist FastAPI's own page would load from a CDN), so the page works on a
host that reaches nothing but the gateway. Its Content-Security-Policy lets it load and
fetch from the gateway's origin only.

The token rule is ``/openapi.json``'s: what the page lists (routes, models, schemas) comes
from ``/openapi.json`` alone, fetched with the bearer token typed into the page (kept in
the tab's ``sessionStorage``) and sent as ``Authorization: Bearer``, as are the page's "Try
it out" requests. A browser sends no bearer header when it opens a page, so the shell and
its assets are public like ``/v2/health/live``: the same bytes for everybody, from a public
package, naming no route, model or token. Without the token the page lists nothing (the
schema fetch answers 401 ``UNAUTHORIZED``). Registered by
:func:`producer.gateway.app.create_app`.
"""

from __future__ import annotations

import html
from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse, Response

__all__ = ["ASSETS_URL", "PAGE_URL", "add_docs_routes", "swagger_ui_dir"]

PAGE_URL = "/docs"
ASSETS_URL = "/docs/assets"
SCRIPT_URL = "/docs/init.js"

# Scripts, styles, images and fetches from the gateway only; Swagger UI sets inline styles.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

PAGE = """<!doctype html>
<html lang="en" data-root="{root}">
<head>
<meta charset="utf-8">
<title>mmfleet gateway API</title>
<link rel="stylesheet" href="{root}{assets}/swagger-ui.css">
<link rel="icon" type="image/png" href="{root}{assets}/favicon.png">
</head>
<body>
<form id="token-form" class="swagger-ui wrapper">
<p>
<label for="token">Gateway token</label>
<input id="token" type="password" autocomplete="off" size="48"
 placeholder="fleet gateway --token prints it">
<button class="btn authorize" type="submit">Load the API</button>
</p>
</form>
<div id="swagger-ui"></div>
<script src="{root}{assets}/swagger-ui-bundle.js"></script>
<script src="{root}{script}"></script>
</body>
</html>
"""

# Swagger UI over /openapi.json; the token (typed, or this tab's earlier one) goes as the
# bearer header of every same-origin request that has no Authorization of its own.
SCRIPT = """"use strict";
(function () {
  var KEY = "mmfleet.gateway.token";
  var root = document.documentElement.dataset.root || "";
  function start(token) {
    window.ui = SwaggerUIBundle({
      url: root + "/openapi.json",
      dom_id: "#swagger-ui",
      validatorUrl: null,
      deepLinking: true,
      requestInterceptor: function (req) {
        var same = new URL(req.url, window.location.href).origin === window.location.origin;
        if (same && !req.headers.Authorization) {
          req.headers.Authorization = "Bearer " + token;
        }
        return req;
      }
    });
  }
  document.getElementById("token-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    var token = document.getElementById("token").value.trim();
    window.sessionStorage.setItem(KEY, token);
    start(token);
  });
  var saved = window.sessionStorage.getItem(KEY);
  if (saved) {
    start(saved);
  }
})();
"""


def swagger_ui_dir() -> Path:
    """The folder of Swagger UI's dist files in the installed ``fastapi-offline`` package."""
    return Path(str(files("fastapi_offline") / "static"))


def add_docs_routes(app: FastAPI) -> None:
    """``/docs``, its script and Swagger UI's files (public: see the module doc)."""
    app.mount(ASSETS_URL, StaticFiles(directory=swagger_ui_dir()), name="docs-assets")

    @app.api_route(PAGE_URL, methods=["GET", "HEAD"], include_in_schema=False)
    async def docs_page(request: Request) -> Response:
        root = html.escape(request.scope.get("root_path", "").rstrip("/"), quote=True)
        body = PAGE.format(root=root, assets=ASSETS_URL, script=SCRIPT_URL)
        return HTMLResponse(body, headers=HEADERS)

    @app.get(SCRIPT_URL, include_in_schema=False)
    async def docs_script() -> Response:
        return Response(SCRIPT, media_type="text/javascript", headers=HEADERS)
