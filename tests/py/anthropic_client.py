#!/usr/bin/env python3
"""One turn against haltd's Messages API with the official Anthropic Python SDK; prints one
JSON line.

The integration tests run this with the interpreter of the venv that `cargo xtask setup`
makes (`HALTD_PYTHON`, with the pinned `anthropic` SDK) to check that a real Anthropic client
sees haltd's `POST /v1/messages` answers, streams and halts as documented.

Usage (see --help):

    anthropic_client.py --base-url http://127.0.0.1:8080 --model builtin --prompt "rivers" \
        --mode stream --max-tokens 50 [--system TEXT] [--tools JSON|FILE] \
        [--tool-choice auto|any|none|tool:NAME|JSON] [--thinking-budget N] \
        [--messages-json JSON|FILE] [--beta NAMES] [--timeout SECONDS]
    anthropic_client.py --base-url URL [common options] --turns JSON|FILE

--base-url is haltd's root (no /v1): the SDK appends /v1/messages itself. The modes:

    create             client.messages.create(stream=False): one batch answer
    stream             with client.messages.stream(...) as s: iterate s, then
                       s.get_final_message() (the SDK's own accumulation)
    create-stream-raw  client.messages.create(stream=True): the raw events, accumulated here

--tools, --tool-choice (as JSON) and --messages-json take inline JSON (it starts with "[" or
"{") or the path of a JSON file. --tools takes a list of Anthropic tool definitions (or one);
--messages-json the whole messages array (multi-turn, tool_use / tool_result blocks), in place
of --prompt. --thinking-budget N sends thinking={"type": "enabled", "budget_tokens": N}.

--turns runs several turns in one process, one after the other (importing the SDK takes a
second or two of CPU, which a test of many turns would otherwise pay per turn): a JSON array
(inline, or the path of a file) with one array of arguments per turn, each parsed after the
other options on the command line, so that a turn's own options override the common ones, e.g.
--turns '[["--mode", "create"], ["--mode", "stream", "--api-key", "k2"]]'. Every turn's
arguments are checked before the first turn runs; each turn has a client of its own, and
prints its line as soon as it ended.

Output, exactly one line of JSON on stdout per turn, every key always present:

    {"ok": bool,                   # no exception was raised
     "mode": str,                  # --mode
     "status": int|null,           # HTTP status of the response (an error: its status_code;
                                   # an `event: error` inside a 200 stream: 200); null if none
     "message_id": str|null,       # message.id (message_start's message in the stream modes)
     "model": str|null,
     "stop_reason": str|null,      # the message's (streams: message_delta's delta)
     "stop_sequence": str|null,
     "stop_details": {...}|null,   # e.g. {"type": "refusal", "category": ..., ...}
     "text": str,                  # text blocks, joined
     "thinking": str,              # thinking blocks, joined
     "tool_uses": [{"id", "name", "input"}],   # tool_use blocks (input: the parsed JSON;
                                               # raw mode: the joined partial_json parsed, or
                                               # the string itself if it does not parse)
     "content_types": [str],       # the content blocks' types, in order
     "usage": {...}|null,          # the final usage as the API sent it (streams: message_start's
                                   # usage with message_delta's non-null counts over it)
     "events": [str],              # stream modes: the event types the SDK yielded, in order
                                   # (never ping, which the SDK drops, nor SSE comments; the
                                   # stream helper's own text/thinking/input_json/signature/
                                   # citation events left out); [] for create
     "halt": any|null,             # the extra "haltd" field of the message_delta event
                                   # (create: of the message), else null
     "headers": {str: str},        # the response's x-haltd-* headers
     "exception": str|null,        # the exception's class name, e.g. "BadRequestError"
     "exception_chain": [str],     # its classes up to Exception, e.g. ["ServiceUnavailableError",
                                   # "InternalServerError", "APIStatusError", "APIError",
                                   # "AnthropicError"]
     "body": any|null,             # the error's body (the parsed JSON error object)
     "message": str|null}          # the exception's message

On an exception the other keys keep what was received before it (a stream's events, text and
halt so far). Exceptions are caught and reported, whatever their class: the SDK's
(`anthropic.APIStatusError` and its subclasses for an HTTP error status or an `event: error`,
`APIConnectionError` for a cut connection, `APIError`), its transport's, and any other (e.g.
the AssertionError of `get_final_message()` on a stream without message_start).

Exit status: 0 whenever a JSON line was printed, including caught exceptions; 2 for usage
errors; 1 for a crash.
"""

import argparse
import json
import sys

import sdk

anthropic = sdk.require("anthropic", "anthropic_client.py")

MODES = ("create", "stream", "create-stream-raw")

# Events that `messages.stream()` adds of its own next to the API's (lib/streaming/_types.py).
HELPER_EVENTS = frozenset(("text", "thinking", "input_json", "signature", "citation"))


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="One turn against haltd's Messages API with the official Anthropic SDK; "
        "prints one JSON line."
    )
    p.add_argument("--base-url", required=True,
                   help="haltd's root, e.g. http://198.18.1.1:8080 (the SDK adds /v1/messages)")
    p.add_argument("--api-key", default="sk-ant-none")
    p.add_argument("--model", default="scripted")
    p.add_argument("--mode", choices=MODES, default="stream")
    p.add_argument("--prompt", default="Tell me about rivers",
                   help="the one user message (unless --messages-json)")
    p.add_argument("--max-tokens", type=int, default=64, help="[64]")
    p.add_argument("--system", default=None, help="the system prompt")
    p.add_argument("--tools", default=None, metavar="JSON|FILE",
                   help="Anthropic tool definitions: a list, or one object")
    p.add_argument("--tool-choice", default=None, metavar="CHOICE",
                   help='auto, any, none, tool:NAME, or a JSON object / file')
    p.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                   help='thinking={"type": "enabled", "budget_tokens": N}')
    p.add_argument("--beta", default=None, metavar="NAMES",
                   help="the anthropic-beta header (comma-separated beta features)")
    p.add_argument("--messages-json", default=None, metavar="JSON|FILE",
                   help="the whole messages array, in place of --prompt")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds, per request [30]")
    p.add_argument("--turns", default=None, metavar="JSON|FILE",
                   help="several turns in one process: a JSON array of argument arrays, each "
                   "parsed after the other options (one output line per turn)")
    a = p.parse_args(argv)
    if a.turns is not None:
        p.error("--turns: not inside a turn's own arguments")
    if a.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if a.timeout <= 0:
        p.error("--timeout must be > 0")
    if a.thinking_budget is not None and a.thinking_budget < 1:
        p.error("--thinking-budget must be >= 1")
    if a.tools is not None:
        a.tools = sdk.json_arg(p, "--tools", a.tools)
        if isinstance(a.tools, dict):
            a.tools = [a.tools]
        if not isinstance(a.tools, list):
            p.error("--tools: a JSON list of tools, or one tool object")
    if a.tool_choice is not None:
        c = a.tool_choice
        if c in ("auto", "any", "none"):
            a.tool_choice = {"type": c}
        elif c.startswith("tool:") and len(c) > len("tool:"):
            a.tool_choice = {"type": "tool", "name": c[len("tool:"):]}
        else:
            a.tool_choice = sdk.json_arg(p, "--tool-choice", c)
            if not isinstance(a.tool_choice, dict):
                p.error("--tool-choice: auto, any, none, tool:NAME or a JSON object")
    if a.messages_json is not None:
        a.messages_json = sdk.json_arg(p, "--messages-json", a.messages_json)
        if not isinstance(a.messages_json, list):
            p.error("--messages-json: a JSON array of messages")
    return a






dump, extra = sdk.dump, sdk.extra


class Turn:
    """What one turn produced; `result()` is the JSON line."""

    def __init__(self, args):
        self.args = args
        self.status = None
        self.message_id = None
        self.model = None
        self.stop_reason = None
        self.stop_sequence = None
        self.stop_details = None
        self.blocks = {}  # index -> accumulated block (the stream modes)
        self.final_blocks = None  # the message's content (create; stream's final message)
        self.usage = None
        self.events = []
        self.halt = None
        self.headers = {}
        self.error = None

    # -- requests ----------------------------------------------------------------------

    def request_kwargs(self):
        a = self.args
        if a.messages_json is not None:
            messages = a.messages_json
        else:
            messages = [{"role": "user", "content": a.prompt}]
        kw = {"model": a.model, "max_tokens": a.max_tokens, "messages": messages}
        if a.system is not None:
            kw["system"] = a.system
        if a.tools is not None:
            kw["tools"] = a.tools
        if a.tool_choice is not None:
            kw["tool_choice"] = a.tool_choice
        if a.thinking_budget is not None:
            kw["thinking"] = {"type": "enabled", "budget_tokens": a.thinking_budget}
        if a.beta is not None:
            kw["extra_headers"] = {"anthropic-beta": a.beta}
        return kw

    def take_response(self, response):
        if response is None:
            return
        self.status = response.status_code
        self.headers = {
            k: v for k, v in response.headers.items() if k.lower().startswith("x-haltd-")}

    def run(self, client):
        try:
            if self.args.mode == "create":
                self.run_create(client)
            elif self.args.mode == "stream":
                self.run_stream(client)
            else:
                self.run_raw(client)
        except Exception as e:  # noqa: BLE001 - every exception is an outcome to report
            self.caught(e)

    def caught(self, e):
        response = getattr(e, "response", None)
        if response is not None:
            self.take_response(response)
        if isinstance(e, anthropic.APIStatusError):
            self.status = e.status_code
        message = getattr(e, "message", None) or str(e)
        cause = e.__cause__
        if isinstance(e, anthropic.APIConnectionError) and cause is not None \
                and str(cause) not in message:
            # "Connection error." alone hides why: add the transport's own error.
            message = "%s (%s: %s)" % (message, type(cause).__name__, cause)
        self.error = {
            "exception": type(e).__name__,
            "exception_chain": sdk.exception_chain(e),
            "body": getattr(e, "body", None),
            "message": message,
        }

    def run_create(self, client):
        raw = client.messages.with_raw_response.create(**self.request_kwargs())
        self.take_response(raw.http_response)
        message = raw.parse()
        self.take_message(message)
        self.halt = extra(message, "haltd")

    def run_stream(self, client):
        with client.messages.stream(**self.request_kwargs()) as s:
            self.take_response(s.response)
            for event in s:
                if event.type not in HELPER_EVENTS:
                    self.take_event(event)
            self.take_message(s.get_final_message())

    def run_raw(self, client):
        stream = client.messages.create(stream=True, **self.request_kwargs())
        with stream:
            self.take_response(stream.response)
            for event in stream:
                self.take_event(event)

    # -- what was received -------------------------------------------------------------

    def take_message(self, message):
        self.message_id = message.id
        self.model = message.model
        self.stop_reason = message.stop_reason
        self.stop_sequence = message.stop_sequence
        self.stop_details = dump(getattr(message, "stop_details", None))
        self.usage = dump(message.usage)
        self.final_blocks = []
        for block in message.content:
            b = {"type": block.type}
            if block.type == "text":
                b["text"] = block.text
            elif block.type == "thinking":
                b["thinking"] = block.thinking
            elif block.type == "tool_use":
                b.update(id=block.id, name=block.name, input=block.input)
            self.final_blocks.append(b)

    def take_event(self, event):
        """Accumulates one raw event (both stream modes: what was seen before an exception)."""
        t = event.type
        self.events.append(t)
        if t == "message_start":
            m = event.message
            self.message_id = m.id
            self.model = m.model
            self.usage = dump(m.usage)
        elif t == "content_block_start":
            cb = event.content_block
            b = {"type": cb.type, "text": "", "thinking": "", "json": ""}
            if cb.type == "text":
                b["text"] = cb.text or ""
            elif cb.type == "thinking":
                b["thinking"] = cb.thinking or ""
            elif cb.type == "tool_use":
                b.update(id=cb.id, name=cb.name, input=cb.input)
            self.blocks[event.index] = b
        elif t == "content_block_delta":
            b = self.blocks.setdefault(
                event.index, {"type": None, "text": "", "thinking": "", "json": ""})
            d = event.delta
            if d.type == "text_delta":
                b["text"] += d.text
            elif d.type == "thinking_delta":
                b["thinking"] += d.thinking
            elif d.type == "input_json_delta":
                b["json"] += d.partial_json
        elif t == "message_delta":
            # getattr: a malformed event is the SDK's to reject, not this accumulation's.
            delta = getattr(event, "delta", None)
            self.stop_reason = getattr(delta, "stop_reason", None)
            self.stop_sequence = getattr(delta, "stop_sequence", None)
            self.stop_details = dump(getattr(delta, "stop_details", None))
            usage = dump(getattr(event, "usage", None)) or {}
            self.usage = dict(self.usage or {})
            self.usage.update({k: v for k, v in usage.items() if v is not None})
            self.halt = extra(event, "haltd")

    def content(self):
        """The content blocks: the message's, else those accumulated from the events."""
        if self.final_blocks is not None:
            return self.final_blocks
        blocks = []
        for i in sorted(self.blocks):
            b = dict(self.blocks[i])
            if b["type"] == "tool_use" and b["json"]:
                try:
                    b["input"] = json.loads(b["json"])
                except ValueError:
                    b["input"] = b["json"]
            blocks.append(b)
        return blocks

    def result(self):
        blocks = self.content()
        error = self.error or {}
        return {
            "ok": self.error is None,
            "mode": self.args.mode,
            "status": self.status,
            "message_id": self.message_id,
            "model": self.model,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "stop_details": self.stop_details,
            "text": "".join(b.get("text") or "" for b in blocks if b["type"] == "text"),
            "thinking": "".join(
                b.get("thinking") or "" for b in blocks if b["type"] == "thinking"),
            "tool_uses": [
                {"id": b.get("id"), "name": b.get("name"), "input": b.get("input")}
                for b in blocks if b["type"] == "tool_use"
            ],
            "content_types": [b["type"] for b in blocks],
            "usage": self.usage,
            "events": self.events,
            "halt": self.halt,
            "headers": self.headers,
            "exception": error.get("exception"),
            "exception_chain": error.get("exception_chain", []),
            "body": error.get("body"),
            "message": error.get("message"),
        }


def main(argv=None):
    argvs = sdk.turn_argvs(sys.argv[1:] if argv is None else argv, "anthropic_client.py")
    # Every turn's arguments are checked before the first one runs.
    turns = [parse_args(a) for a in argvs]
    for args in turns:
        turn = Turn(args)
        turn.run(sdk.client(anthropic, anthropic.Anthropic, args))
        sys.stdout.write(json.dumps(turn.result()) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
