"""A request body that is not the method's message ends INVALID_ARGUMENT, not UNKNOWN.

grpc Python parses a request with the handler's `request_deserializer` before the handler runs;
a `DecodeError` there ends the call UNKNOWN with the exception's text. This interceptor (every
server's first, `build_server`) takes the parsing over: the handler receives the raw bytes,
parses them itself and aborts with INVALID_ARGUMENT (a `google.rpc.BadRequest` naming the field
`request`) when they are not the message. Streamed requests are parsed one by one as the
handler reads them.
"""

from __future__ import annotations

import inspect
from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError

from services.base.errors import InvalidArgument
from services.serving.status import abort_for

FIELD = "request"  # the BadRequest field of a body that is not the method's message


class NotTheMessage(InvalidArgument):
    def __init__(self, method: str, exc: BaseException):
        super().__init__(FIELD, f"the body is not a valid request message of {method} ({type(exc).__name__})")


def _parser(deserializer, method: str):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, ValueError, RuntimeError, TypeError) as exc:
            raise NotTheMessage(method, exc) from None
    return parse


async def _parse_or_abort(parse, data, context):
    try:
        return parse(data)
    except NotTheMessage as exc:
        await abort_for(context, exc)


def _streaming(inner, make_input):
    """A handler like `inner` (an async generator that yields responses, or a coroutine that
    writes them with `context.write`) whose input `make_input(raw, context)` (awaited) makes."""
    if inspect.isasyncgenfunction(inner):
        async def generator(raw, context):
            async with aclosing(inner(await make_input(raw, context), context)) as responses:
                async for response in responses:
                    yield response
        return generator

    async def coroutine(raw, context):
        return await inner(await make_input(raw, context), context)
    return coroutine


def _guard(handler, method: str):
    deserializer = handler.request_deserializer
    if deserializer is None:
        return handler
    parse = _parser(deserializer, method)

    async def one(data, context):
        return await _parse_or_abort(parse, data, context)

    async def each(requests, context):
        async def parsed():
            async for data in requests:
                yield await _parse_or_abort(parse, data, context)
        return parsed()

    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                if getattr(handler, k) is not None)
    make_input = each if handler.request_streaming else one
    return handler._replace(request_deserializer=None, **{kind: _streaming(getattr(handler, kind), make_input)})


class DecodeGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not hasattr(handler, "_replace"):
            return handler
        return _guard(handler, handler_call_details.method)
