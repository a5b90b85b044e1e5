"""The browser playground (docs/playground.md): static files served at `/` and `/playground`.

It sits in front of the API-key gate: the page holds nothing but its own code, and every API
call it makes carries the key the user types, so the gate still checks those. The page is told
only whether a key is needed (`data-key-required`), never the key nor the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from starlette.responses import Response

from freetoken.serving.client import FrontendManager

STATIC = Path(__file__).parent
PAGE_PATHS = ("/", "/playground", "/playground/")
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# Everything comes from this server (no CDN, no inline script or style), and nothing else may
# frame the page, where it could be made to send requests with the user's key.
_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
}
_KEY_SLOT = b'data-key-required="?"'


class Playground:
    """ASGI wrapper answering GETs of the playground's paths; everything else goes to `app`."""

    def __init__(self, app, get_state: Callable[[], FrontendManager]):
        self.app, self.get_state = app, get_state
        # Read once: a fixed set of small files, and no request path ever reaches the disk.
        self.files = {f"/playground/{p.name}": (p.read_bytes(), _TYPES[p.suffix])
                      for p in sorted(STATIC.iterdir()) if p.suffix in _TYPES}

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["method"] in ("GET", "HEAD")
                and (response := self._response(scope["path"])) is not None):
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _response(self, path: str) -> Response | None:
        page = path in PAGE_PATHS
        if not (page or path in self.files):
            return None
        config = self.get_state().config
        if not config.playground:
            return None
        body, media_type = self.files["/playground/index.html" if page else path]
        if page:
            required = b'data-key-required="%s"' % (b"true" if config.api_key else b"false")
            body = body.replace(_KEY_SLOT, required)
        return Response(body, media_type=media_type, headers=_HEADERS)
