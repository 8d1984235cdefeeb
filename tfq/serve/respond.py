"""The route of OpenAI's Responses API: the request as a chat (tfq/serve/responses.py), run as
/v1/chat/completions runs it (tfq/serve/app.py's steps), its reply as output items."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from tfq.serve.compiles import Compiles
from tfq.serve.flow import _check, _events, collect, finished, salt, shaped, submit, tool_grammar
from tfq.serve.intake import ApiError, Served, chat_prompt, check_model, validation_message
from tfq.serve.loop import Token
from tfq.serve.protocol import ChatBody
from tfq.serve.replies import ChoiceStream, Shape, chat_choice
from tfq.serve.responses import (
    Builder,
    ResponsesBody,
    ResponseStore,
    chat_fields,
    input_messages,
    reply_messages,
    sse_event,
    stream_events,
)


def responses_route(v1: APIRouter, served: Served, compiles: Compiles) -> None:
    store = ResponseStore()

    @v1.post("/responses")
    async def responses(body: ResponsesBody, http: HttpRequest):
        return await respond(served, compiles, store, body, http)


async def respond(served: Served, compiles: Compiles, store: ResponseStore, body: ResponsesBody, http: HttpRequest):
    """POST /v1/responses: the request as a chat (tfq/serve/responses.py), run as /v1/chat/completions runs it."""
    history: list[dict] = []
    if body.previous_response_id is not None:
        history = store.get(body.previous_response_id)
        if history is None:
            raise ApiError(400, f"previous_response_id: no response {body.previous_response_id!r} is kept here (this "
                           f"server keeps its last {store.most}, until it restarts); send the whole conversation "
                           f"as input", "previous_response_id")
    try:
        fields = chat_fields(body, history)
        chat_body = ChatBody.model_validate(fields)
    except ValueError as e:
        if isinstance(e, ValidationError):
            message, param = validation_message(e.errors())
        else:
            message, param = str(e), "input"
        raise ApiError(400, message, param) from None
    check_model(served, chat_body)
    chat = await asyncio.to_thread(chat_prompt, served, chat_body)
    requests, matchers = await shaped(served, compiles, chat_body, salt(http), lambda: chat_body.requests(
        [chat.ids], served.window, chat_body.reply_tokens, None, constraint=tool_grammar(served, chat_body)))
    shape = Shape.new("chat", served.model, tools=chat_body.calling, thinking=chat.inside)
    ticket = submit(served, requests, matchers)
    builder = Builder(served.model)

    def keep(message: dict) -> None:  # the conversation without this request's instructions: they do not carry over
        store.put(builder.id, history + input_messages(body) + reply_messages(message))

    if body.stream:
        async def deltas():
            stream = ChoiceStream(shape)
            async for event in _events(ticket):
                if isinstance(event, Token):
                    yield stream.feed(event.output.text), None
                else:
                    result = _check(event.result)
                    keep(chat_choice(shape, served.tokenizer, 0, result)["message"])  # kept before it is told
                    finished(served, [result])
                    yield stream.finish(), result

        async def events():
            try:
                async for text in stream_events(builder, body, deltas(), len(chat.ids)):
                    yield text
            except ApiError as e:  # the stream failed: its error as the last event
                served.metrics.outcome(e.outcome)
                yield sse_event("error", 0, message=e.message, code=e.kind, param=e.param)
            finally:
                served.loop.abort(ticket)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = (await collect(served, ticket, http))[0]
    message = chat_choice(shape, served.tokenizer, 0, result)["message"]
    builder.items = builder.from_choice(message)
    keep(message)
    return builder.response(body, "completed", result, len(chat.ids))
