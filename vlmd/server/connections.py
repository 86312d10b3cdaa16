"""A bound on open client connections (``--max-connections``, issue 36 item 3, D85).

Every connection holds a file descriptor, idle or not, and a process whose descriptor table
is full cannot accept anyone: not a good client, not a load balancer's health check. The
read deadlines (``--request-read-timeout``, ``--keepalive-timeout``) end each slow or idle
connection, but many at once can still fill the table before their deadlines come. So
connections are counted from ``connection_made`` to ``connection_lost`` (the descriptor's
life) and answered in three tiers:

- below the bound: served as usual;
- the next ``MONITOR_HEADROOM``: served one request each and then closed; a monitoring
  route (``MONITOR_PATHS``) is answered as usual, anything else is a 503 naming the flag,
  so ``/health`` and ``/metrics`` answer while the bound is reached;
- beyond those: a canned 503 is written and the connection closed as it is accepted, which
  costs the loop one write and one close and never stalls the connections it serves (a
  client that sent its request before the close may see a reset instead of the 503).

The count wraps aiohttp's protocol (one forwarding call per received chunk) instead of
reading its server's private connection table, which also drops a connection only after
its handler task ends.
"""

from __future__ import annotations

import asyncio
import resource

import orjson
import structlog
from aiohttp import web

from vlmd.errors import ServiceUnavailableError

log = structlog.get_logger(__name__)

# What load balancers, routers (vllm-router polls /health and /get_load) and Prometheus ask.
MONITOR_PATHS = frozenset({"/health", "/ping", "/metrics", "/get_load"})
# Connections past the bound that may still ask a monitoring route: a balancer, a router, a
# scraper and an operator's curl, with room to spare; each is closed after one answer.
MONITOR_HEADROOM = 16
DEFAULT_BOUND = 4096
# Descriptors kept out of the bound: the listening socket, the event loop's own, log files,
# media fetches and encoder-server calls (one per preprocessing thread), rank pipes.
DESCRIPTOR_RESERVE = 256


def connection_bound(configured: int | None) -> int:
    """The bound to serve under: ``--max-connections``, else ``DEFAULT_BOUND``; the soft
    open-file limit is raised (up to the hard one) so the bound, the headroom and the
    reserve fit. A default that still does not fit shrinks to what does; an explicit bound
    that does not is refused (ValueError) before the model loads."""
    wanted = (configured or DEFAULT_BOUND) + MONITOR_HEADROOM + DESCRIPTOR_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):  # a sandbox may refuse: the limit stays as it is
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return configured or DEFAULT_BOUND
    fits = soft - MONITOR_HEADROOM - DESCRIPTOR_RESERVE
    if configured is not None:
        raise ValueError(f"--max-connections {configured} needs {wanted} open files, and the open-file limit is "
                         f"{soft} (raise it with ulimit -n, or lower --max-connections)")
    bound = max(1, fits)
    log.warning("the open-file limit bounds connections below the default", max_connections=bound,
                open_file_limit=soft, default=DEFAULT_BOUND)
    return bound


class ConnectionBound:
    """The protocol factory (``__call__``) that counts and tiers connections, and the
    middleware that answers the headroom tier."""

    def __init__(self, bound: int, headroom: int = MONITOR_HEADROOM):
        self.server: web.Server | None = None  # the runner's, once set up (BoundedSockSite.start)
        self.bound = bound
        self.headroom = headroom
        self.open = 0
        self.refused = 0  # closed as accepted, since the start
        self.over_bound: set = set()  # aiohttp handlers of the headroom tier's connections
        self.error = ServiceUnavailableError(
            f"the server holds its most open connections ({bound}, --max-connections); retry later")
        body = orjson.dumps(self.error.to_dict())
        self.refusal = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                        % (self.error.retry_after_s, len(body), body))

    def __call__(self) -> asyncio.Protocol:
        return _Counted(self)

    def middleware(self):
        from vlmd.server.app import vlmd_error_response

        @web.middleware
        async def bound_connections(request: web.Request, handler):
            if request.protocol not in self.over_bound:
                return await handler(request)
            if request.path in MONITOR_PATHS:
                response = await handler(request)
            else:
                response = vlmd_error_response(self.error)
            if not response.prepared:  # one answer: a headroom slot is for the next monitor
                response.force_close()
            return response

        return bound_connections


class _Counted(asyncio.Protocol):
    """One connection: aiohttp's handler behind a count, or nothing (refused)."""

    __slots__ = ("_bound", "_inner")

    def __init__(self, bound: ConnectionBound):
        self._bound = bound
        self._inner = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        bound = self._bound
        if bound.open >= bound.bound + bound.headroom:
            bound.refused += 1
            transport.write(bound.refusal)
            transport.close()
            return
        inner = bound.server()  # created here, not in the factory: a refused connection costs none
        bound.open += 1
        if bound.open > bound.bound:
            bound.over_bound.add(inner)
        self._inner = inner
        inner.connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        inner = self._inner
        if inner is None:
            return
        self._inner = None
        self._bound.open -= 1
        self._bound.over_bound.discard(inner)
        inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class BoundedSockSite(web.BaseSite):
    """aiohttp's ``SockSite`` with the bound's factory in front of the runner's server."""

    __slots__ = ("_sock", "_bound", "_name")

    def __init__(self, runner: web.AppRunner, sock, bound: ConnectionBound, backlog: int):
        super().__init__(runner, backlog=backlog)
        self._sock = sock
        self._bound = bound
        host, port = sock.getsockname()[:2]
        self._name = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._bound.server = self._runner.server
        self._server = await loop.create_server(self._bound, sock=self._sock, backlog=self._backlog)
