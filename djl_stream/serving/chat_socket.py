"""A conversation over a WebSocket: ``/ws/chat`` of ``djl-stream serve``.

Each connection keeps its own conversation. A client sends a user turn, as plain text or
as JSON (``{"content": "...", "parameters": {...}}``, with an optional ``"system"``
prompt); the server streams the answer back as it is generated and remembers both turns,
so the next turn is rendered with the whole history through the tokenizer's chat template.
Messages from the server are JSON:

- ``{"type": "token", "text": "..."}``, once per decode step;
- ``{"type": "end", "finish_reason": ..., "prompt_tokens": ..., "generated_tokens": ...,
  "dropped_turns": ...}`` when the turn ends (``finish_reason`` is ``cancelled`` for a turn
  that was stopped);
- ``{"type": "error", "code": ..., "field": ..., "message": ...}`` for a turn that could
  not run (a bad parameter, a full queue, a server shutting down); the socket stays open.

A turn goes through the model's ``handle()`` like an HTTP request (djl's protocol with
``messages``), so it shares the running batch, the validation, the limits and the metrics
with every other request. When the conversation outgrows ``option.max_input_length``, the
oldest turns are dropped (never the system prompt or the current turn) and the end message
counts them. ``{"type": "cancel"}``, a new turn sent while one streams, and a client that
disconnects each stop the running turn at the next decode step.

Example (the ``websockets`` package's client)::

    from websockets.sync.client import connect

    with connect("ws://localhost:8080/ws/chat") as socket:
        socket.send("Space the final")
        while (message := json.loads(socket.recv()))["type"] == "token":
            print(message["text"], end="")
"""

from __future__ import annotations

import json
import logging
from typing import Any, List, Optional, Tuple

import anyio
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from djl_stream.protocols.protocol import PROTOCOL_PROPERTY
from djl_stream.serving.access import BEARER_SUBPROTOCOL
from djl_stream.serving.cancellation import Cancellation, attach_cancellation
from djl_stream.serving.stream_pump import PumpFailure, StreamPump
from djl_stream.serving.worker import READY, next_stream_chunk, output_body

logger = logging.getLogger(__name__)

#: What a too-long conversation's refusal names: the handler's own limit.
LENGTH_LIMIT = "(option.max_input_length)"


class TurnError(Exception):
    """A turn that could not run, with what the client is told."""

    def __init__(self, code: int, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field

    def as_message(self) -> dict:
        return {"type": "error", "code": self.code, "field": self.field,
                "message": self.message}


def read_turn(text: str) -> Tuple[str, Any]:
    """``("user", (content, parameters, system))``, ``("cancel", None)`` or
    ``("reset", None)`` from one client message; raises :class:`TurnError` otherwise.

    >>> read_turn("Space the final")
    ('user', ('Space the final', {}, None))
    >>> read_turn('{"type": "cancel"}')
    ('cancel', None)
    """
    stripped = text.strip()
    if not stripped.startswith("{"):
        if not stripped:
            raise TurnError(400, "a turn must not be empty", "content")
        return "user", (text, {}, None)
    try:
        message = json.loads(stripped)
    except ValueError as error:
        raise TurnError(400, f"not JSON: {error}", "message") from None
    kind = message.get("type", "user")
    if kind in ("cancel", "reset"):
        return kind, None
    if kind != "user":
        raise TurnError(400, f"type must be user, cancel or reset, got {kind!r}", "type")
    content = message.get("content", message.get("text"))
    if not isinstance(content, str) or not content.strip():
        raise TurnError(400, "content must be a non-empty string", "content")
    parameters = message.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise TurnError(400, "parameters must be an object", "parameters")
    system = message.get("system")
    if system is not None and not isinstance(system, str):
        raise TurnError(400, "system must be a string", "system")
    return "user", (content, parameters, system)


class Conversation:
    """One connection's turns: an optional system prompt and alternating user and
    assistant messages.

    >>> chat = Conversation()
    >>> chat.add("user", "Hi"); chat.add("assistant", "Hello!"); chat.add("user", "Bye")
    >>> chat.drop_oldest_turn(), [m["content"] for m in chat.messages()]
    (True, ['Bye'])
    """

    def __init__(self) -> None:
        self.system: Optional[str] = None
        self.turns: List[dict] = []

    def add(self, role: str, content: str) -> None:
        self.turns.append({"role": role, "content": content})

    def messages(self) -> List[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def drop_oldest_turn(self) -> bool:
        """Forget the oldest user turn and its answer, never the current (last) turn."""
        if len(self.turns) <= 1:
            return False
        del self.turns[0]
        while len(self.turns) > 1 and self.turns[0]["role"] != "user":
            del self.turns[0]
        return True


class ChatSocket:
    """The ``/ws/chat`` endpoint (:meth:`serve`) over a server's worker, admission and
    thread limiter."""

    def __init__(self, server: Any) -> None:
        self.server = server

    async def serve(self, websocket: WebSocket) -> None:
        """One connection, from its handshake to its close."""
        # A browser that sent the API key as a subprotocol (RequireApiKey checked it) needs
        # it chosen in the answer, or it drops the connection.
        offered = websocket.scope.get("subprotocols") or []
        await websocket.accept(subprotocol=next(
            (p for p in offered if p.startswith(BEARER_SUBPROTOCOL)), None))
        conversation = Conversation()
        running: Optional[Cancellation] = None
        finished = anyio.Event()
        finished.set()
        async with anyio.create_task_group() as tasks:
            try:
                while True:
                    text = await websocket.receive_text()
                    try:
                        kind, turn = read_turn(text)
                    except TurnError as error:
                        await websocket.send_json(error.as_message())
                        continue
                    if running is not None:  # (a new turn or a cancel stops the running one)
                        running.cancel()  # (as for a client that left: no error record)
                        await finished.wait()
                        running = None
                    if kind == "reset":
                        conversation = Conversation()
                    if kind != "user":
                        continue
                    content, parameters, system = turn
                    if system is not None:
                        conversation.system = system
                    conversation.add("user", content)
                    running, finished = Cancellation(), anyio.Event()
                    tasks.start_soon(self._run_turn, websocket, conversation, parameters,
                                     running, finished)
            except WebSocketDisconnect:
                if running is not None:
                    running.cancel()  # (the client left: nobody reads the answer)
                tasks.cancel_scope.cancel()

    async def _run_turn(self, websocket: WebSocket, conversation: Conversation,
                        parameters: dict, cancellation: Cancellation,
                        finished: anyio.Event) -> None:
        answer: List[str] = []
        try:
            end = await self._generate(websocket, conversation, parameters, cancellation,
                                       answer)
            await websocket.send_json(end)
        except TurnError as error:
            conversation.turns.pop()  # (the turn never ran: it is not part of the history)
            await websocket.send_json(error.as_message())
        except (WebSocketDisconnect, RuntimeError) as error:
            if websocket.application_state == WebSocketState.CONNECTED and not isinstance(
                    error, WebSocketDisconnect):
                raise  # (not the socket closing under the turn: a fault to report)
            logger.debug("chat socket closed during a turn: %s", error)
        finally:
            text = "".join(answer)
            if text.strip():  # (a stopped answer stays in the history as far as it went;
                conversation.add("assistant", text)  # a blank one is no message at all)
            finished.set()

    async def _generate(self, websocket: WebSocket, conversation: Conversation,
                        parameters: dict, cancellation: Cancellation,
                        answer: List[str]) -> dict:
        worker, server = self.server.worker, self.server
        if worker.status != READY:
            raise TurnError(503, worker.not_ready_message())
        dropped = 0
        while True:
            body = {"messages": conversation.messages(), "stream": True,
                    "parameters": {**parameters, "details": True}}
            output = await self._invoke(body, cancellation)
            if int(output.code) < 400:
                break
            error = _error_of(output)
            if (error.field == "messages" and LENGTH_LIMIT in error.message
                    and conversation.drop_oldest_turn()):
                dropped += 1
                continue
            raise error
        end = {"type": "end", "finish_reason": None, "prompt_tokens": None,
               "generated_tokens": None, "dropped_turns": dropped}
        # One thread pulls the stream for the turn's life, as for an HTTP stream; stopped
        # and waited for before close(), which must never run beside a next().
        pump = StreamPump(lambda: next_stream_chunk(output))
        failure: Optional[Exception] = None
        try:
            async with anyio.create_task_group() as pumping:
                pumping.start_soon(pump.run, server.limiter)
                try:
                    done = None
                    while done is None:
                        chunks, done = await pump.take()
                        for chunk in chunks:
                            await _forward(websocket, chunk, answer, end)
                    if isinstance(done, PumpFailure):
                        raise TurnError(500, str(done.error))
                except Exception as error:  # (raised below as itself, not in a task group's)
                    failure = error
                finally:
                    pump.stop()
            if failure is not None:
                raise failure
        finally:
            close = getattr(output.stream_content, "close", None)
            if close is not None:
                await anyio.to_thread.run_sync(close, limiter=server.limiter)
            server.admission.release(cancellation)
        if cancellation.cancelled:
            end.update(finish_reason="cancelled", generated_tokens=len(answer))
        return end

    async def _invoke(self, body: dict, cancellation: Cancellation) -> Any:
        server = self.server
        if server.admission.admit(cancellation) is None:
            raise TurnError(503, "the server is shutting down")
        inp = server.worker.make_input(json.dumps(body).encode("utf-8"),
                                       {"content-type": "application/json"})
        inp.properties[PROTOCOL_PROPERTY] = "djl"
        attach_cancellation(inp, cancellation)
        output = await anyio.to_thread.run_sync(server.worker.invoke, inp,
                                                limiter=server.limiter)
        if int(output.code) >= 400 or getattr(output, "stream_content", None) is None:
            server.admission.release(cancellation)
            if int(output.code) < 400:
                raise TurnError(500, "the handler answered without a stream")
        return output


async def _forward(websocket: WebSocket, chunk: bytes, answer: List[str], end: dict) -> None:
    """Send the text of one decode step's record (djl's per-token details) to the client,
    or keep what its last record says for ``end``."""
    for line in chunk.decode("utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("tokens"):
            text = "".join(token["text"] for token in record["tokens"] if token)
            answer.append(text)
            await websocket.send_json({"type": "token", "text": text})
        elif record.get("details"):
            details = record["details"][0]
            end.update(finish_reason=details.get("finish_reason"),
                       prompt_tokens=details.get("prompt_tokens"),
                       generated_tokens=details.get("generated_tokens"))
        elif "error" in record:
            raise TurnError(500, str(record["error"]))


def _error_of(output: Any) -> TurnError:
    """The handler's error answer as a :class:`TurnError`: djl's JSON body (its ``error``
    detail where it has one, else its ``message``), or a bodiless 507's status message."""
    try:
        error = json.loads(output_body(output))
    except ValueError:
        error = {}
    message = error.get("error") or error.get("message") or output.message
    return TurnError(int(output.code), str(message), error.get("field"))
