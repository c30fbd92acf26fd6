"""A scripted model server, on 127.0.0.1, for driving real agent runtimes in tests.

Agent runtimes (OpenCode, Codex) talk to a model over HTTP. This server stands
in for the model: it speaks the wire formats those runtimes use, and instead
of thinking it plays a script. Everything the runtime sends is recorded, so a
test can assert what the session really carried (its system prompt, the
rendered agent file, AGENTS.md, the tool list) and what it did with the
script's tool calls (the tool results that came back).

Wire formats (checked against the runtimes' own request and stream parsers):

- OpenAI chat completions, `POST /v1/chat/completions`, streamed as
  server-sent events of `chat.completion.chunk`s (text deltas, `tool_calls`
  deltas, a `finish_reason`, a usage chunk, `[DONE]`), or one JSON body when
  the request has no `stream`. OpenCode's `@ai-sdk/openai-compatible`
  provider uses it.
- OpenAI responses, `POST /v1/responses`, streamed as `response.*` events
  (`response.created`, `response.output_item.done` for each message or
  `function_call` item, `response.completed` with usage). Codex uses it.
- `GET /v1/models` answers a one-model list for runtimes that ask.

A script is a list of `Rule`s. Each request is first reduced to a `Turn`:
the system text (system and developer messages, and instructions), the user
text, the tool calls and results the runtime sent back, the tools offered,
and how many times the model has already answered in this conversation
(`step`). The first rule whose
`when` matches the turn's system text (or its user text) answers it: its `play(turn)`
returns a `Reply` (text, or tool calls by name and arguments). Replies depend
only on what was sent, never on the order sessions arrive in, so concurrent
sessions (a primary and its subagents, two workers at once) each follow their
own part of the script. A turn no rule matches gets a short plain answer (a
runtime's own side requests, such as titling a session, land there) and is
recorded as unscripted.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass
class Call:
    """One tool call the model makes: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]
    namespace: str | None = None  # a tool inside a namespace of tools (Codex's multi-agent tools)


@dataclass
class Reply:
    """What the model answers: text, tool calls, or both (text first)."""

    text: str = ""
    calls: list[Call] = field(default_factory=list)


@dataclass
class Turn:
    """One request, reduced to what a script decides on."""

    api: str                     # "chat" or "responses"
    system: str                  # system/developer messages and instructions, joined
    user: str                    # the user messages, joined
    results: list[str]           # the outputs of the tool calls so far, in order
    tools: list[str]             # names of the tools offered
    step: int                    # how many model answers the conversation already holds
    body: dict                   # the request as sent
    user_messages: list[str] = field(default_factory=list)  # each user message, in order
    calls: list[Call] = field(default_factory=list)  # the model's tool calls, as sent back

    @property
    def last_result(self) -> str:
        return self.results[-1] if self.results else ""


@dataclass
class Rule:
    """Answers the turns whose system text (or user text, with `in_user`) matches `when`."""

    name: str
    when: str
    play: Callable[[Turn], Reply]
    in_user: bool = False  # a prompt handed over as the user's message (Codex's parent)

    def matches(self, turn: Turn) -> bool:
        return bool(re.search(self.when, turn.user if self.in_user else turn.system))


@dataclass
class Exchange:
    """One recorded request and the reply the script gave it."""

    path: str
    body: dict
    turn: Turn | None
    rule: str | None
    reply: Reply | None
    at: float


def _text(content: Any) -> str:
    """The text of a message's content: a string, or a list of parts with text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _arguments(text: Any) -> dict:
    try:
        return json.loads(text) if isinstance(text, str) else dict(text or {})
    except (json.JSONDecodeError, TypeError, ValueError):
        return {"unparsed": text}


def chat_turn(body: dict) -> Turn:
    system, user, results, step, calls = [], [], [], 0, []
    for m in body.get("messages", []):
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text(m.get("content")))
        elif role == "user":
            user.append(_text(m.get("content")))
        elif role == "assistant":
            step += 1
            calls += [Call(c["function"]["name"], _arguments(c["function"].get("arguments")))
                      for c in m.get("tool_calls") or []]
        elif role == "tool":
            results.append(_text(m.get("content")))
    tools = [t.get("function", {}).get("name", "") for t in body.get("tools") or []]
    return Turn("chat", "\n".join(system), "\n".join(user), results, tools, step, body, user,
                calls)


def responses_turn(body: dict) -> Turn:
    system = [_text(body.get("instructions"))]
    user, results, step, answered, calls = [], [], 0, False, []
    items = body.get("input") or []
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    for it in items:
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role in ("system", "developer"):
                system.append(_text(it.get("content")))
            elif role == "user":
                user.append(_text(it.get("content")))
                answered = False
            elif role == "assistant" and not answered:
                step, answered = step + 1, True
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            if not answered:
                step, answered = step + 1, True
            calls.append(Call(it.get("name", kind), _arguments(it.get("arguments")),
                              it.get("namespace")))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out = it.get("output")
            results.append(out if isinstance(out, str) else _text(out))
            answered = False
    tools = [t.get("name") or t.get("type", "") for t in body.get("tools") or []]
    return Turn("responses", "\n".join(s for s in system if s), "\n".join(user), results,
                tools, step, body, user, calls)


class ScriptedModel:
    """The server: `with ScriptedModel(rules) as model:` serves at `model.url` (…/v1)."""

    def __init__(self, rules: list[Rule], model: str = "scripted"):
        self.rules = rules
        self.model = model
        self.exchanges: list[Exchange] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._ids = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "ScriptedModel":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- what tests read ------------------------------------------------------------------

    def turns(self, rule: str | None = None) -> list[Turn]:
        """The turns a rule answered (every scripted turn without `rule`), in arrival order."""
        return [e.turn for e in self.exchanges
                if e.turn is not None and e.rule is not None and (rule is None or e.rule == rule)]

    def calls(self, rule: str | None = None) -> list[Call]:
        """The tool calls the script made (a rule's, or all), in the order it made them."""
        return [c for e in self.exchanges if e.reply and e.rule is not None
                and (rule is None or e.rule == rule) for c in e.reply.calls]

    def replies_to(self, conversation: Turn) -> list[Call]:
        """The calls the script made in one conversation: its answers to the earlier requests
        that `conversation` continues (the same system text, their user messages first)."""
        def earlier(t: Turn) -> bool:
            return (t.system == conversation.system and t.step < conversation.step
                    and conversation.user_messages[:len(t.user_messages)] == t.user_messages)
        return [c for e in self.exchanges if e.turn and e.reply and e.rule is not None
                and earlier(e.turn) for c in e.reply.calls]

    def transcript(self) -> str:
        """A short account of every exchange, for assertion messages."""
        lines = []
        for e in self.exchanges:
            what = "; ".join(f"{c.name}({json.dumps(c.arguments)[:160]})"
                             for c in (e.reply.calls if e.reply else [])) or \
                (e.reply.text[:80] if e.reply else "")
            last = (e.turn.last_result if e.turn else "")[-300:].replace("\n", " | ")
            lines.append(f"{e.path} rule={e.rule} step={e.turn.step if e.turn else '-'} "
                         f"last_result={last!r} -> {what}")
        return "\n".join(lines + [f"ERROR {x}" for x in self.errors])

    # --- answering -------------------------------------------------------------------------

    def _next_id(self, prefix: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{prefix}_{self._ids}"

    def answer(self, path: str, body: dict) -> tuple[Turn, str | None, Reply]:
        turn = chat_turn(body) if path.endswith("/chat/completions") else responses_turn(body)
        for rule in self.rules:
            if rule.matches(turn):
                try:
                    return turn, rule.name, rule.play(turn)
                except Exception as e:  # a script bug must show in the test, not hang it
                    self.errors.append(f"rule {rule.name} step {turn.step}: {e!r}")
                    return turn, rule.name, Reply(text=f"script error: {e!r}")
        return turn, None, Reply(text="Autolab session")

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: the exchanges are the record
                pass

            def _json(self, code: int, doc: dict) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                with server._lock:
                    server.exchanges.append(Exchange(self.path, {}, None, None, None, time.time()))
                if self.path.rstrip("/").endswith("/models"):
                    self._json(200, {"object": "list", "data": [
                        {"id": server.model, "object": "model", "created": 0,
                         "owned_by": "autolab-tests"}]})
                else:
                    self._json(404, {"error": {"message": f"no {self.path}"}})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    server.errors.append(f"{self.path}: body is not JSON")
                    self._json(400, {"error": {"message": "body is not JSON"}})
                    return
                path = self.path.split("?")[0].rstrip("/")
                if not path.endswith(("/chat/completions", "/responses")):
                    server.exchanges.append(Exchange(path, body, None, None, None, time.time()))
                    self._json(404, {"error": {"message": f"no {path}"}})
                    return
                turn, rule, reply = server.answer(path, body)
                with server._lock:
                    server.exchanges.append(Exchange(path, body, turn, rule, reply, time.time()))
                if path.endswith("/chat/completions"):
                    self._chat(body, reply)
                else:
                    self._responses(body, reply)

            # --- OpenAI chat completions -----------------------------------------------------

            def _chat(self, body: dict, reply: Reply) -> None:
                cid = server._next_id("chatcmpl")
                calls = [{"id": server._next_id("call"), "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                         for c in reply.calls]
                finish = "tool_calls" if calls else "stop"
                usage = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
                if not body.get("stream"):
                    msg: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
                    if calls:
                        msg["tool_calls"] = calls
                    self._json(200, {"id": cid, "object": "chat.completion", "created": 0,
                                     "model": server.model, "usage": usage,
                                     "choices": [{"index": 0, "message": msg,
                                                  "finish_reason": finish}]})
                    return

                def chunk(delta: dict, finish_reason=None, **extra) -> dict:
                    return {"id": cid, "object": "chat.completion.chunk", "created": 0,
                            "model": server.model, **extra,
                            "choices": [{"index": 0, "delta": delta,
                                         "finish_reason": finish_reason}]}

                events = [chunk({"role": "assistant", "content": ""})]
                if reply.text:
                    events.append(chunk({"content": reply.text}))
                for i, c in enumerate(calls):
                    events.append(chunk({"tool_calls": [{"index": i, **c}]}))
                events.append(chunk({}, finish))
                events.append({"id": cid, "object": "chat.completion.chunk", "created": 0,
                               "model": server.model, "choices": [], "usage": usage})
                self._stream([f"data: {json.dumps(e)}\n\n" for e in events] +
                             ["data: [DONE]\n\n"])

            # --- OpenAI responses ----------------------------------------------------------

            def _responses(self, body: dict, reply: Reply) -> None:
                rid = server._next_id("resp")
                items: list[dict] = []
                if reply.text:
                    items.append({"type": "message", "id": server._next_id("msg"),
                                  "role": "assistant", "status": "completed",
                                  "content": [{"type": "output_text", "text": reply.text,
                                               "annotations": []}]})
                for c in reply.calls:
                    item = {"type": "function_call", "id": server._next_id("fc"),
                            "call_id": server._next_id("call"), "name": c.name,
                            "arguments": json.dumps(c.arguments), "status": "completed"}
                    if c.namespace:
                        item["namespace"] = c.namespace
                    items.append(item)
                usage = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": 110}
                base = {"id": rid, "object": "response", "created_at": int(time.time()),
                        "model": server.model}
                if not body.get("stream"):
                    self._json(200, {**base, "status": "completed", "output": items,
                                     "usage": usage})
                    return
                events = [("response.created",
                           {"type": "response.created",
                            "response": {**base, "status": "in_progress", "output": []}})]
                for i, it in enumerate(items):
                    events.append(("response.output_item.added",
                                   {"type": "response.output_item.added", "output_index": i,
                                    "item": it}))
                    events.append(("response.output_item.done",
                                   {"type": "response.output_item.done", "output_index": i,
                                    "item": it}))
                events.append(("response.completed",
                               {"type": "response.completed",
                                "response": {**base, "status": "completed", "output": items,
                                             "usage": usage}}))
                self._stream([f"event: {name}\ndata: {json.dumps(e)}\n\n" for name, e in events])

            def _stream(self, frames: list[str]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for f in frames:
                    self.wfile.write(f.encode())
                    self.wfile.flush()
                self.close_connection = True

        return Handler
