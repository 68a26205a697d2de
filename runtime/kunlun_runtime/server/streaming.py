"""Reading an engine stream for the client: whole (``collect``) or as server-sent events.

A non-streaming call waits for every final output while watching for the client going away, and
aborts its requests when it does. A streaming response sends ``data: {...}`` events and closes
(aborts) its engine stream however it ends. Once the headers are sent an error can only be an
event: ``guard_stream`` sends it in OpenAI's error body, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.errors import ERROR_TYPES, APIError
from kunlun_runtime.server.request_stream import RequestStream

SSE_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(stream: RequestStream, request: Request) -> dict[str, RequestOutput]:
    """The final output of every request of ``stream``; aborts them if the client goes away."""

    async def final_outputs() -> dict[str, RequestOutput]:
        return {output.request_id: output async for output in stream if output.finished}

    consume = asyncio.ensure_future(final_outputs())
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({consume, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not consume.done():
            raise APIError(400, "client disconnected")
        return consume.result()
    finally:
        consume.cancel()
        watch.cancel()
        stream.close()


def sse(data: BaseModel | dict) -> str:
    payload = data.model_dump(exclude_none=False) if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events over an engine stream; the stream is closed (aborted) however it ends."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


async def guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """After the headers are sent an error can only be an event: send it, then [DONE]."""
    try:
        async for event in events:
            yield event
    except InvalidRequestError as error:
        yield error_event(error.status_code, error.message, error.field)
    except APIError as error:  # e.g. 503: the server is draining and its timeout has passed
        yield error_event(error.status_code, error.message, error.param)
    except Exception as error:  # e.g. EngineDeadError: the stream must still end cleanly
        yield error_event(500, str(error))
    yield SSE_DONE


def error_event(status_code: int, message: str, param: str | None = None) -> str:
    """An SSE event with OpenAI's error body."""
    error_type = ERROR_TYPES.get(status_code, "Error")
    return sse({"error": {"message": message, "type": error_type, "param": param, "code": status_code}})
