"""The HTTP server under every kvturn process (worker and router): uvicorn, whose own answer to a request its
parser refuses before any app sees it (a control character in the request line, a malformed header line) is plain
text. kvturn's is an OpenAI-shaped JSON error there too, like every other answer."""
import gc
import os

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvturn.config import INSTANCE_ENV, INSTANCE_HEADER, SERVER_KEEP_ALIVE_S
from kvturn.errors import error_body


class JsonErrorsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering a request it cannot parse with JSON, then closing the connection."""

    def send_400_response(self, msg: str) -> None:
        body = orjson.dumps(error_body(400, "malformed HTTP request: the server's HTTP parser refused it"))
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def instance_headers() -> dict[str, str]:
    """/health's header naming the stack this process belongs to, where its launcher named one (config.INSTANCE_ENV)."""
    name = os.environ.get(INSTANCE_ENV)
    return {INSTANCE_HEADER: name} if name else {}


def run_server(app, host: str, port: int) -> None:
    """Serve `app` until stopped; idle connections are kept longer than kvturn's clients keep them."""
    freeze_startup_heap()
    uvicorn.run(app, host=host, port=port, http=JsonErrorsProtocol, log_level="warning", timeout_graceful_shutdown=30,
                timeout_keep_alive=SERVER_KEEP_ALIVE_S)


def freeze_startup_heap() -> None:
    """Take what start-up made (imports, the model, the pool's bookkeeping: ~350k objects in a worker) out of the
    garbage collector's view, as vLLM's engine does: a full collection walks every tracked object, and one that
    came due during a turn stalled it for hundreds of ms (more with a 25k-token prompt's garbage to trigger it)."""
    gc.collect()
    gc.freeze()
