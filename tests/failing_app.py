"""`python tests/failing_app.py PORT`: kvturn's router app, as `kvturn router` runs it, with one route more,
POST /boom, that raises: an internal error, answered and logged by kvturn's own handler (kvturn/errors.py)."""
import sys

from kvturn.cli import setup_logging
from kvturn.config import RouterConfig
from kvturn.http_server import run_server
from kvturn.router.app import create_app

if __name__ == "__main__":
    port = int(sys.argv[1])
    nowhere = "http://127.0.0.1:9"  # no worker: the router starts and answers without one
    app = create_app(RouterConfig(prefill_urls=[nowhere], decode_urls=[nowhere], port=port))

    @app.post("/boom")
    async def boom():
        raise RuntimeError("a bug")

    setup_logging("info")
    run_server(app, "127.0.0.1", port)
