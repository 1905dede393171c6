"""`localrt serve`: uvicorn on LOCALRT_HOST (loopback by default), stopped gracefully.

The first SIGTERM or SIGINT stops accepting connections and starts the drain (`localrt/api/drain.py`):
new requests on open connections get 503 with `Retry-After`, requests in flight run on for up to
LOCALRT_SHUTDOWN_GRACE, then what still runs ends with its protocol's error chunk; then the connections
close, the runtime frees its engines and models, and the signal is raised again, as uvicorn does (exit
status -SIGTERM, or 130 for SIGINT). A second signal of either kind stops at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
from types import FrameType
from typing import Any

from localrt import config
from localrt.cli.common import Subparsers
from localrt.cli.common import recover_store

# once the drain is done: how long uvicorn waits for the last connections before it cancels them
CLOSE_S = 5.0

log = logging.getLogger("localrt")


def add_serve(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="start the HTTP server on LOCALRT_HOST",
        description="Start the HTTP server on LOCALRT_HOST, set up by the environment variables below.",
        epilog=config.help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the table's lines as they are
    )
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from localrt.api.app import create_app
    from localrt.runtime import memory
    from localrt.runtime.front import Runtime

    host, port = config.host()
    memory.fewer_heap_arenas()  # before the server's threads start
    runtime = Runtime()
    app = create_app(runtime=runtime, bind_host=host)

    @app.on_event("shutdown")
    async def stop_runtime() -> None:
        loaded = [row.name for row in runtime.ps()]
        await runtime.close()  # cancels what still runs and unloads every model, freeing its engine
        log.info("stopped: %s", f"unloaded {', '.join(loaded)}" if loaded else "no model was loaded")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("localrt serving on http://%s:%d (models: %s)", host, port, config.models_dir())
    recover_store(log.info)  # what killed writes left in the store: removed, or kept for resuming
    report = runtime.device_report()
    log.info("%s", report[0])
    for line in report[1:]:  # a GPU the build leaves idle: said once, as a warning
        log.warning("%s", line)
    server = graceful_server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=int(CLOSE_S),
            timeout_keep_alive=5,
        ),
        app.state.drain,
    )
    server.run()
    return 0


def graceful_server(uvicorn_config: Any, drain: Any) -> Any:
    """uvicorn's server with the drain in front of its own shutdown (which closes the connections,
    cancels what still runs after CLOSE_S and runs the app's shutdown), and a second SIGTERM as final
    as a second SIGINT. (Made here, so importing the CLI does not import uvicorn.)"""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:
                self.force_exit = True
                log.warning("stopping now (%s again)", signal.Signals(sig).name)
            else:
                log.info("stopping (%s): new requests get 503", signal.Signals(sig).name)
            drain.begin()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            for server in self.servers:  # no new connections; open ones stay to hear their 503
                server.close()
            for sock in sockets or []:
                sock.close()
            await drain.finish(lambda: self.force_exit)
            await super().shutdown(sockets=None)

    return GracefulServer(uvicorn_config)
