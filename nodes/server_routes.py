"""HTTP routes and websocket events of the SP panel: GET /ulysses_sp/status, POST /ulysses_sp/unload and
/ulysses_sp/shutdown (also under /api/), and pool events pushed to every browser while models load and sample."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from .pool_owner import OWNER

log = logging.getLogger("ulysses_sp")
_registered = False


def push_event(event: str, data: dict) -> None:
    """Forward an owner event to every connected browser (send_sync is safe from the execution thread)."""
    from server import PromptServer
    if PromptServer.instance is not None:
        PromptServer.instance.send_sync(event, data)


async def _in_thread(function, *args):
    # pool status may wait on the workers: never block ComfyUI's event loop
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(await _in_thread(OWNER.status))


async def post_unload(request: web.Request) -> web.Response:
    count = await _in_thread(OWNER.unload_all)
    return web.json_response({"unloaded": count, "status": await _in_thread(OWNER.status)})


async def post_shutdown(request: web.Request) -> web.Response:
    count = await _in_thread(OWNER.shutdown)
    return web.json_response({"closed": count, "status": await _in_thread(OWNER.status)})


def register() -> bool:
    """Add the routes and the event listener once; False where no ComfyUI server runs (scripts, tests)."""
    global _registered
    if _registered:
        return True
    try:
        from server import PromptServer
    except ImportError:
        return False
    server = PromptServer.instance
    if server is None:
        return False
    server.routes.get("/ulysses_sp/status")(get_status)
    server.routes.post("/ulysses_sp/unload")(post_unload)
    server.routes.post("/ulysses_sp/shutdown")(post_shutdown)
    OWNER.add_listener(push_event)
    _registered = True
    return True
