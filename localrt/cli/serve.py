"""`localrt serve`: uvicorn on LOCALRT_HOST (loopback by default) with a graceful shutdown."""

from __future__ import annotations

import argparse
import logging

from localrt import config
from localrt.cli.common import Subparsers
from localrt.cli.common import recover_store


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
    from localrt.runtime.front import Runtime

    host, port = config.host()
    runtime = Runtime()
    app = create_app(runtime=runtime, bind_host=host)

    @app.on_event("shutdown")
    async def stop_runtime() -> None:
        await runtime.close()  # cancels in-flight generations so their streams end cleanly

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("localrt")
    log.info("localrt serving on http://%s:%d (models: %s)", host, port, config.models_dir())
    recover_store(log.info)  # what killed writes left in the store: removed, or kept for resuming
    report = runtime.device_report()
    log.info("%s", report[0])
    for line in report[1:]:  # a GPU the build leaves idle: said once, as a warning
        log.warning("%s", line)
    uvicorn.run(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10, timeout_keep_alive=5
    )
    return 0
