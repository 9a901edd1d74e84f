"""The server process (``python -m infer.serve``): HTTP on a thread, decoding on the initial thread.

The scheduler's loop runs every decoding pass. On the process's initial thread the kernels'
parallel work goes to OpenMP's team, which torch's own operations share; on any other thread
it goes to the kernels' own pool (medusa/runtime/pool.c), and torch's operations there start a
second OpenMP team, so two sets of workers wait for the same cores. So the loop runs here, on
the initial thread, and uvicorn's event loop (parsing, streaming; no tensor work) on a thread
of its own (docs/serving.md#the-decoding-thread).

Signals: uvicorn installs its handlers only on the initial thread, so this module installs
them: SIGINT or SIGTERM asks uvicorn to shut down as it would itself (stop accepting, let open
streams finish for up to ``graceful`` seconds, then the app's shutdown closes the scheduler,
whose running requests finish); a second signal forces it.
"""

from __future__ import annotations

import signal
import threading

from medusa.errors import MedusaError
from medusa.serving.server import Server, create_app


def serve(server: Server, host: str, port: int, log_level: str = "info", graceful: float = 30.0) -> None:
    """Serve ``server`` on ``host``:``port`` until a signal stops it (see the module docstring).
    Raises :class:`MedusaError` where the HTTP side could not start (the port taken...)."""
    import uvicorn

    web = uvicorn.Server(uvicorn.Config(create_app(server, run_scheduler=False), host=host, port=port,
                                        log_level=log_level, timeout_graceful_shutdown=graceful))

    def stop(signum, frame) -> None:
        web.force_exit = web.should_exit
        web.should_exit = True

    def http() -> None:
        try:
            web.run()
        except SystemExit:  # uvicorn's own exit where it cannot bind: said in its log
            pass
        finally:
            server.scheduler.close(timeout=0)  # the loop ends once its requests do

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="medusa-http", daemon=True)
    try:
        thread.start()
        server.scheduler.run()
    finally:
        web.should_exit = True  # the loop ended (closed, or a fault of its own): so does the HTTP side
        thread.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not web.started:
        raise MedusaError(f"could not serve on {host}:{port} (the reason is logged above): pick another --port "
                          "or stop what holds it")
