"""`listen`: start an aiohttp application on an address and return the runner and the bound port.

Why it exists: the reference engine embedded by `lockstep run`, the trainer group's command server and
the TITO session server each served an aiohttp app the same way (an AppRunner without access logs, a
TCPSite, then the port actually bound when 0 asked for a free one); this is that way, once.
`lockstep engine` is the one server started otherwise: aiohttp's run_app owns its process (signals,
graceful shutdown bounded by --drain-timeout).

Who calls it: lockstep.driver.engines, lockstep.trainer.server, lockstep.rollout.session.server.
"""

from __future__ import annotations

from aiohttp import web

from lockstep.serving.guard import IDLE_TIMEOUT_S


async def listen(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout: float = 60.0,
    keepalive_timeout: float = IDLE_TIMEOUT_S,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (port 0: a free one); returns the runner (`await runner.cleanup()`
    stops it) and the bound port. `shutdown_timeout`: seconds cleanup waits for open requests;
    `keepalive_timeout`: seconds an idle keep-alive connection stays open (the engine's 75 s by
    default; aiohttp's AppRunner would keep it 3630 s)."""
    runner = web.AppRunner(
        app, access_log=None, shutdown_timeout=shutdown_timeout, keepalive_timeout=keepalive_timeout
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
