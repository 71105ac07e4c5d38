"""OpenAI-shaped errors and strict JSON bodies, shared by worker and router: every answer is JSON, even for a
route that does not exist, a body no JSON parser should accept, or a bug."""
import json
import logging
import os
import uuid

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvturn.config import LOG_FILE_ENV

log = logging.getLogger("kvturn.errors")
MAX_JSON_DEPTH = 64
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError", 422: "UnprocessableEntityError", 499: "ClientClosedRequest",
               503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param))


def internal_error_message(what: str, request_id: str) -> str:
    """What a client is told of a failure on our side: enough for an operator to find its traceback, nothing more."""
    where = os.environ.get(LOG_FILE_ENV) or "this process's log"
    return f"{what} (request {request_id}; its traceback is in {where})"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


_CONTAINERS = (dict, list)


def _depth_ok(raw: bytes, value, limit: int) -> bool:
    if raw.count(b"[") + raw.count(b"{") <= limit:  # cannot nest deeper than it has brackets (most bodies)
        return True
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        children = item.values() if isinstance(item, dict) else item
        if set(map(type, children)).isdisjoint(_CONTAINERS):  # in C: lists of thousands of ints end here
            continue
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)
    return True


def _parse_with_json(raw: bytes):
    """What orjson refused, through Python's json: for its error message, and to tell a lone UTF-16 surrogate
    escape (which JSON's grammar allows and orjson refuses) from other errors. Such a string is not text: the
    tokenizer and every encoder downstream would fail on it with a 500, so it is a 400 here."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise BadRequest(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if _has_lone_surrogate(body):
        raise BadRequest("malformed JSON body: a string holds a lone UTF-16 surrogate escape (not Unicode text)")
    return body


def _has_lone_surrogate(value) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


async def read_body(request: Request, max_mb: float) -> bytes:
    """The request's body, refused (413) past `max_mb` MiB before it is held: at once when its Content-Length says
    so, else as soon as what came (a chunked body) passes the cap; the server discards the rest."""
    limit = int(max_mb * 2**20)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the request body is over {max_mb:g} MiB", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is over {max_mb:g} MiB", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object; BadRequest for anything else (NaN and Infinity included, which
    Python's json accepts and no other JSON parser does, and nesting deeper than any API needs)."""
    try:
        body = orjson.loads(raw)  # refuses NaN and Infinity itself
    except orjson.JSONDecodeError:
        body = _parse_with_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if not _depth_ok(raw, body, MAX_JSON_DEPTH):
        raise BadRequest(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    return body


def install_error_handlers(app: FastAPI, logger: logging.Logger) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}")
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return error_response(400, message, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                            str(exc.detail))
        return error_response(exc.status_code, message)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect):
        """A client that hangs up while sending its body is not our error: one line, and an answer nobody reads."""
        logger.info("client left during its request body: %s %r", request.method, request.url.path)
        return error_response(499, "the client closed the connection before its request body was complete")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        request_id = uuid.uuid4().hex
        logger.error("unhandled error in %s %r (request %s)", request.method, request.url.path, request_id,
                     exc_info=exc)
        return error_response(500, internal_error_message(f"internal error {type(exc).__name__}", request_id))
