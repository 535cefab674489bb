"""The page for people: GET / (kvmemory/server/web/index.html) and its script and style under
/ui/. Plain files shipped in the wheel: no CDN, no build step. They hold no data, so they are
served without the API key; the page asks for the key and sends it with every API call."""

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from kvmemory.server.errors import ApiError

router = APIRouter(include_in_schema=False)
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
OPEN = ("/",) + tuple(f"/ui/{name}" for name in ASSETS)


def _read(name: str) -> bytes:
    return resources.files("kvmemory.server").joinpath("web", name).read_bytes()


@router.get("/")
async def page():
    return HTMLResponse(_read("index.html"), headers={"Cache-Control": "no-cache"})


@router.get("/ui/{name}")
async def asset(name: str):
    if name not in ASSETS:
        raise ApiError(404, f"no page asset {name!r}", code="not_found")
    return Response(_read(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})
