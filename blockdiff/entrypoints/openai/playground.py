"""The playground: a page at `/` that chats with this server and shows each canvas denoising live
(docs/server.md, "The playground"). Its HTML, CSS and JavaScript ship in the package (static/) and
are served from memory; they load nothing from anywhere else, and the Content-Security-Policy
header lets the browser fetch from this server alone. The page and its files are public, as
/health is: they hold nothing of the server's, and every call the page makes sends the API key."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from blockdiff.entrypoints.openai.errors import APIError

_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8"}
_FILES = {f.name: f.read_bytes() for f in resources.files(__package__).joinpath("static").iterdir()
          if f.is_file() and f.name[f.name.rfind("."):] in _TYPES}
_ASSETS = {name: data for name, data in _FILES.items() if name != "index.html"}
# Paths served without the API key (RequireAPIKey): exactly these, so an unknown path still needs it.
PUBLIC_PATHS = frozenset({"/", *(f"/static/{name}" for name in _ASSETS)})
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def install(app: FastAPI, api_key_required: bool) -> None:
    """Serve the page at `/` and its files under /static/. The page learns from its own HTML whether
    to ask for the key before its first call."""
    page = _FILES["index.html"].replace(b"__API_KEY__", b"required" if api_key_required else b"none")

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return Response(page, media_type=_TYPES[".html"], headers=_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in _ASSETS:
            raise APIError(404, f"no file /static/{name}", code="not_found")
        return Response(_ASSETS[name], media_type=_TYPES[name[name.rfind("."):]], headers=_HEADERS)
