"""Running the app on the listening socket until a signal: what ``web.run_app`` did, with
the connection bound (``vlmd/server/connections.py``) in front of aiohttp's protocol.

``run_app`` builds its own runner and site, so nothing can stand between the listening
socket and aiohttp's server; this is its sequence spelled out with the same settings:
SIGINT / SIGTERM end the server gracefully (the runner's handlers raise ``GracefulExit``),
shutdown waits up to 60 s for requests in flight, tasks left are cancelled, and the loop
is closed. The socket is served before the model is loaded (``load``): until then the app
answers every route with a 503 "loading" (``app.until_loaded``).
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import suppress
from collections.abc import Awaitable, Callable

from aiohttp import web

from vlmd.server.connections import BoundedSockSite, ConnectionBound

# bind_socket listens with this backlog; run_app re-listened with its own default of 128,
# which a burst of connections (the bound's own tests open hundreds) can overflow.
BACKLOG = 1024


def run(app: web.Application, sock: socket.socket, loop: asyncio.AbstractEventLoop, *, bound: ConnectionBound,
        keepalive_timeout: float, load: Callable[[], Awaitable[None]], on_listening: Callable[[], None],
        on_ready: Callable[[], None]) -> None:
    """Serve ``app`` on ``sock`` until SIGINT or SIGTERM: ``on_listening`` once it accepts,
    then ``load()`` (the model; its failure ends the server with its exception), then
    ``on_ready``."""
    app.middlewares.insert(0, bound.middleware())  # outermost: the headroom tier answers before any other work
    main = loop.create_task(_serve(app, sock, bound, keepalive_timeout, load, on_listening, on_ready))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():  # a signal: the runner's cleanup runs in the cancelled task
                main.cancel()
                with suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


async def _serve(app: web.Application, sock: socket.socket, bound: ConnectionBound, keepalive_timeout: float,
                 load: Callable[[], Awaitable[None]], on_listening: Callable[[], None],
                 on_ready: Callable[[], None]) -> None:
    # handler_cancellation: a client that leaves cancels its handler (and so its engine
    # request); access_log None: vlmd logs its own events, not a line per request.
    runner = web.AppRunner(app, handle_signals=True, handler_cancellation=True, access_log=None,
                           keepalive_timeout=keepalive_timeout)
    await runner.setup()
    try:
        await BoundedSockSite(runner, sock, bound, backlog=BACKLOG).start()
        on_listening()
        await load()
        on_ready()
        await asyncio.Event().wait()  # until a signal's GracefulExit, or a cancel
    finally:
        await runner.cleanup()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks still pending (as run_app and asyncio.run do) and report their errors."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler({"message": "unhandled exception during shutdown",
                                         "exception": task.exception(), "task": task})
