"""HTTP routes and websocket events of the SP panel: GET /ulysses_sp/status, POST /ulysses_sp/unload,
/ulysses_sp/shutdown and /ulysses_sp/doctor (also under /api/), and pool events pushed to every browser while models
load and sample."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from .doctor_button import DoctorBusy, doctor_report
from .pool_owner import OWNER

log = logging.getLogger("ulysses_sp")
_registered = False


def push_event(event: str, data: dict) -> None:
    """Forward an owner event to every connected browser (send_sync is safe from the execution thread)."""
    from server import PromptServer
    if PromptServer.instance is not None:
        if event == "ulysses_sp.step":  # the panel's chart starts over with each prompt, whoever queued it
            data = {**data, "prompt_id": _running_prompt_id(PromptServer.instance)}
        PromptServer.instance.send_sync(event, data)


def _running_prompt_id(server):
    # ComfyUI sends its own execution events only to the client that queued the prompt; the queue tells everyone
    try:
        running, _ = server.prompt_queue.get_current_queue_volatile()
        return running[0][1] if running else None
    except (AttributeError, IndexError, TypeError):
        return None


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


async def post_doctor(request: web.Request) -> web.Response:
    """The doctor's recommendation for the first pool's devices and model (or 2 CPU workers when no pool runs);
    409 while another doctor runs."""
    pools = OWNER.status()["pools"]
    devices = pools[0]["devices"] if pools else ["cpu", "cpu"]
    family = next((model.get("family") for pool in pools for model in pool["models"]), None)
    try:
        report = await _in_thread(doctor_report, devices, family)
    except DoctorBusy as error:
        return web.json_response({"error": str(error)}, status=409)
    except Exception as error:  # noqa: BLE001 - shown in the panel
        return web.json_response({"error": str(error)}, status=500)
    return web.json_response({"devices": devices, "recommendation": report.get("recommendation"),
                              "machine_load": report.get("machine_load")})


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
    server.routes.post("/ulysses_sp/doctor")(post_doctor)
    OWNER.add_listener(push_event)
    _registered = True
    return True
