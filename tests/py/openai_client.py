#!/usr/bin/env python3
"""One turn against haltd with the official OpenAI Python SDK; prints one JSON line.

The integration tests run this with the interpreter of the venv that `cargo xtask setup`
makes (`HALTD_PYTHON`, with the pinned `openai` SDK) to check that a real OpenAI client sees
haltd's streams, batch answers and halts as documented in docs/wire-format.md.

Usage (see --help):

    openai_client.py --base-url http://127.0.0.1:8080/v1 --model builtin --prompt "rivers" \
        --stream --max-tokens 50 [--logprobs] [--tools] \
        [--trip-after K --admin-url http://127.0.0.1:8081 --admin-token-file FILE]

Output, exactly one line of JSON on stdout:

    {"ok": bool,                      # no error was caught and the answer carries none
     "stream_id": str|null,           # the x-haltd-stream-id response header
     "content": str,                  # content (chat) or text (completions) received
     "chunks": int,                   # streamed token chunks: a choice with finish_reason null
                                      # (0 for --no-stream)
     "finish_reason": str|null,       # the last non-null finish_reason received
     "tool_calls": [...],             # tool calls (stream: deltas merged per index)
     "logprobs_tokens": int,          # logprob entries received (chat: logprobs.content items,
                                      # completions: logprobs.tokens items)
     "usage": {...}|null,             # usage object (streaming: only with --include-usage)
     "error": {"class": str|null, "message": str, "body": any, "status_code": int|null}|null,
     "headers": {"x-haltd-mode": str|null, "x-haltd-stream-id": str|null,
                 "x-haltd-halted": str|null},
     "trip": {"status": int|null, "body": any, "after_chunks": int|null,
              "stream_id": str|null, "error": str|null}|null}

"error" is the exception the SDK (or its HTTP transport) raised, with what was received
before it kept: a haltd halt in a stream surfaces as `openai.APIError` (class "APIError",
status_code null, body = haltd's error object with "type": "halted" and "code") right after
a chunk with finish_reason "content_filter". An HTTP error status surfaces as an
`APIStatusError` subclass with its status_code and body. A halted batch answer (haltd's
degraded-safe response) raises nothing in the SDK: its top-level "error" object is reported
with "class": null and the HTTP status.

"trip" is null without --trip-after. With it, the script POSTs
{admin-url}/admin/streams/{stream_id}/trip (with urllib) once K token chunks were received
(K = 0: right after the response head) and reports the answer's status and body (JSON if it
parses, else text); "error" says why no answer came (trip not reached, transport error). For
--no-stream the stream id is not known before the whole answer, so the script finds the turn
in GET {admin-url}/admin/streams instead (the only open batch turn with at least K tokens).

Exit status: 0 whenever a JSON line was printed, including caught API errors; 2 for usage
errors; 1 for a crash.
"""

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request

import sdk

openai = sdk.require("openai", "openai_client.py")
OpenAI = openai.OpenAI

# The SDK's HTTP transport (httpx2 in openai 3.x, httpx before): its errors that escape the
# SDK while a stream is read (a connection reset or cut) are an outcome, not a crash.
try:
    import httpx2 as _http
except ImportError:  # pragma: no cover - older SDKs
    import httpx as _http

TRANSPORT_ERRORS = (openai.OpenAIError, _http.HTTPError, _http.StreamError, OSError)

HALTD_HEADERS = ("x-haltd-mode", "x-haltd-stream-id", "x-haltd-halted")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}

# urllib without proxies from the environment: haltd runs on loopback or in test namespaces.
_URLLIB = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="One turn against haltd with the official OpenAI SDK; prints one JSON line."
    )
    p.add_argument("--base-url", required=True, help="e.g. http://198.18.1.1:8080/v1")
    p.add_argument("--api-key", default="sk-none")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--prompt", default="Tell me about rivers")
    p.add_argument("--model", default="scripted")
    p.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=True,
        help="SSE streaming (default) or one batch answer (--no-stream)",
    )
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument(
        "--logprobs", action="store_true",
        help="chat: logprobs=True, top_logprobs=2; completions: logprobs=2",
    )
    p.add_argument("--tools", action="store_true", help="offer the tool get_weather(city) (chat)")
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos: true")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--include-usage", action="store_true",
        help="streaming: stream_options.include_usage=true (a usage chunk before [DONE])",
    )
    p.add_argument("--trip-after", type=int, default=None, metavar="K",
                   help="trip the turn through the admin API after K token chunks")
    p.add_argument("--admin-url", default=None, help="e.g. http://198.18.1.1:8081")
    p.add_argument("--admin-token-file", default=None,
                   help="the bearer token of haltd's TCP admin listener (--admin-token-file)")
    p.add_argument("--trip-cause", default=None,
                   help='body {"cause": ...} for the trip (default: empty body, OPERATOR_TRIP)')
    p.add_argument("--timeout", type=float, default=30.0, help="seconds, per request [30]")
    a = p.parse_args(argv)
    if a.trip_after is not None:
        if a.trip_after < 0:
            p.error("--trip-after must be >= 0")
        if not a.admin_url:
            p.error("--trip-after needs --admin-url")
    elif a.trip_cause is not None:
        p.error("--trip-cause needs --trip-after")
    if a.tools and a.endpoint != "chat":
        p.error("--tools needs --endpoint chat")
    if a.include_usage and not a.stream:
        p.error("--include-usage is for --stream (batch answers always have usage)")
    if a.max_tokens is not None and a.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if a.timeout <= 0:
        p.error("--timeout must be > 0")
    return a


def dump(obj):
    """A pydantic model (or list of them) as plain JSON data; None stays None."""
    if obj is None:
        return None
    if isinstance(obj, list):
        return [dump(o) for o in obj]
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json", exclude_unset=True)
    return obj




json_or_text = sdk.json_or_text


class Turn:
    """What one turn produced; `result()` is the JSON line."""

    def __init__(self, args):
        self.args = args
        self.content = []
        self.chunks = 0
        self.finish_reason = None
        self.tool_calls = {}  # index -> merged call (stream), or list (batch)
        self.batch_tool_calls = None
        self.logprobs_tokens = 0
        self.usage = None
        self.error = None
        self.headers = {h: None for h in HALTD_HEADERS}
        self.trip = None
        self.tripped = False
        if args.trip_after is not None:
            self.trip = {"status": None, "body": None, "after_chunks": None,
                         "stream_id": None, "error": "not tripped: the turn ended before it"}

    def admin_headers(self):
        """The bearer token of a TCP admin listener, if a token file was given."""
        if not self.args.admin_token_file:
            return {}
        with open(self.args.admin_token_file) as f:
            return {"authorization": "Bearer " + f.read().strip()}

    # -- headers and errors ------------------------------------------------------------

    def take_headers(self, headers):
        for h in HALTD_HEADERS:
            self.headers[h] = headers.get(h)

    def caught(self, e):
        response = getattr(e, "response", None)
        if response is not None and self.headers["x-haltd-stream-id"] is None:
            self.take_headers(response.headers)
        message = getattr(e, "message", None) or str(e)
        if isinstance(e, openai.APIConnectionError) and e.__cause__ is not None:
            # "Connection error." alone hides why: add the transport's own error.
            message = "%s (%s: %s)" % (message, type(e.__cause__).__name__, e.__cause__)
        self.error = {
            "class": type(e).__name__,
            "message": message,
            "body": getattr(e, "body", None),
            "status_code": getattr(e, "status_code", None),
        }

    # -- trips -------------------------------------------------------------------------

    def trip_now(self, stream_id):
        self.tripped = True
        self.trip = {"status": None, "body": None, "after_chunks": self.chunks,
                     "stream_id": stream_id, "error": None}
        if not stream_id:
            self.trip["error"] = "no x-haltd-stream-id header: cannot trip"
            return
        url = "%s/admin/streams/%s/trip" % (self.args.admin_url.rstrip("/"), stream_id)
        data = b""
        # haltd refuses admin POSTs that are not JSON, whatever their body.
        headers = self.admin_headers()
        headers["content-type"] = "application/json"
        if self.args.trip_cause is not None:
            data = json.dumps({"cause": self.args.trip_cause}).encode()
        req = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with _URLLIB.open(req, timeout=self.args.timeout) as r:
                self.trip["status"] = r.status
                self.trip["body"] = json_or_text(r.read())
        except urllib.error.HTTPError as e:
            self.trip["status"] = e.code
            self.trip["body"] = json_or_text(e.read())
        except (urllib.error.URLError, OSError) as e:
            self.trip["error"] = "POST %s: %s" % (url, e)

    def start_batch_tripper(self):
        """--no-stream: find the held batch turn in the admin API and trip it at K tokens."""
        done = threading.Event()
        url = self.args.admin_url.rstrip("/") + "/admin/streams"
        k = self.args.trip_after
        deadline = time.monotonic() + self.args.timeout

        def poll():
            last = "no open batch turn seen"
            while not done.is_set() and time.monotonic() < deadline:
                try:
                    req = urllib.request.Request(url, headers=self.admin_headers())
                    with _URLLIB.open(req, timeout=self.args.timeout) as r:
                        streams = json.loads(r.read()).get("streams", [])
                except (urllib.error.URLError, OSError, ValueError) as e:
                    last = "GET %s: %s" % (url, e)
                    time.sleep(0.002)
                    continue
                ready = [s for s in streams
                         if s.get("mode") == "batch" and s.get("trip_cause") is None
                         and (s.get("tokens") or 0) >= k]
                if len(ready) > 1:
                    last = "%d open batch turns with >= %d tokens: cannot tell which" % (
                        len(ready), k)
                    break
                if ready:
                    self.trip_now(ready[0].get("stream_id"))
                    self.trip["after_chunks"] = None
                    return
                time.sleep(0.002)
            self.trip = {"status": None, "body": None, "after_chunks": None,
                         "stream_id": None, "error": "not tripped: " + last}

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        return done, t

    # -- requests ----------------------------------------------------------------------

    def request_kwargs(self):
        a = self.args
        kw = {"model": a.model}
        extra = {}
        if a.endpoint == "chat":
            kw["messages"] = [{"role": "user", "content": a.prompt}]
            if a.logprobs:
                kw["logprobs"] = True
                kw["top_logprobs"] = 2
            if a.tools:
                kw["tools"] = [WEATHER_TOOL]
        else:
            kw["prompt"] = a.prompt
            if a.logprobs:
                kw["logprobs"] = 2
        if a.max_tokens is not None:
            kw["max_tokens"] = a.max_tokens
        if a.seed is not None:
            kw["seed"] = a.seed
        if a.stream:
            kw["stream"] = True
            if a.include_usage:
                kw["stream_options"] = {"include_usage": True}
        if a.ignore_eos:
            extra["ignore_eos"] = True
        if extra:
            kw["extra_body"] = extra
        return kw

    def resource(self, client):
        if self.args.endpoint == "chat":
            return client.chat.completions
        return client.completions

    def run(self, client):
        try:
            if self.args.stream:
                self.run_stream(client)
            else:
                self.run_batch(client)
        except TRANSPORT_ERRORS as e:
            self.caught(e)

    def run_stream(self, client):
        k = self.args.trip_after
        with self.resource(client).with_streaming_response.create(**self.request_kwargs()) as r:
            self.take_headers(r.headers)
            if k == 0:
                self.trip_now(self.headers["x-haltd-stream-id"])
            for chunk in r.parse():
                self.take_chunk(chunk)
                if k is not None and not self.tripped and self.chunks >= k:
                    self.trip_now(self.headers["x-haltd-stream-id"])

    def take_chunk(self, chunk):
        if getattr(chunk, "usage", None) is not None:
            self.usage = dump(chunk.usage)
        for choice in chunk.choices or []:
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
            else:
                self.chunks += 1
            if self.args.endpoint == "chat":
                delta = choice.delta
                if delta is not None:
                    if delta.content:
                        self.content.append(delta.content)
                    for tc in delta.tool_calls or []:
                        self.merge_tool_call(tc)
                if choice.logprobs is not None:
                    self.logprobs_tokens += len(choice.logprobs.content or [])
            else:
                if choice.text:
                    self.content.append(choice.text)
                if choice.logprobs is not None:
                    self.logprobs_tokens += len(choice.logprobs.tokens or [])

    def merge_tool_call(self, tc):
        call = self.tool_calls.setdefault(
            tc.index,
            {"index": tc.index, "id": None, "type": None,
             "function": {"name": "", "arguments": ""}},
        )
        if tc.id:
            call["id"] = tc.id
        if tc.type:
            call["type"] = tc.type
        if tc.function is not None:
            call["function"]["name"] += tc.function.name or ""
            call["function"]["arguments"] += tc.function.arguments or ""

    def run_batch(self, client):
        tripper = None
        if self.args.trip_after is not None:
            tripper = self.start_batch_tripper()
        try:
            r = self.resource(client).with_raw_response.create(**self.request_kwargs())
        finally:
            if tripper is not None:
                tripper[0].set()
                tripper[1].join(self.args.timeout)
        self.take_headers(r.headers)
        answer = r.parse()
        self.usage = dump(answer.usage)
        for choice in answer.choices or []:
            self.finish_reason = choice.finish_reason
            if self.args.endpoint == "chat":
                message = choice.message
                if message is not None:
                    self.content.append(message.content or "")
                    self.batch_tool_calls = dump(message.tool_calls) or []
                if choice.logprobs is not None:
                    self.logprobs_tokens += len(choice.logprobs.content or [])
            else:
                self.content.append(choice.text or "")
                if choice.logprobs is not None:
                    self.logprobs_tokens += len(choice.logprobs.tokens or [])
        halted = (answer.model_extra or {}).get("error")
        if halted is not None:
            message = halted.get("message") if isinstance(halted, dict) else None
            self.error = {
                "class": None,
                "message": message or "the answer carries an error object",
                "body": halted,
                "status_code": r.http_response.status_code,
            }

    def result(self):
        if self.batch_tool_calls is not None:
            tool_calls = self.batch_tool_calls
        else:
            tool_calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return {
            "ok": self.error is None,
            "stream_id": self.headers["x-haltd-stream-id"],
            "content": "".join(self.content),
            "chunks": self.chunks,
            "finish_reason": self.finish_reason,
            "tool_calls": tool_calls,
            "logprobs_tokens": self.logprobs_tokens,
            "usage": self.usage,
            "error": self.error,
            "headers": dict(self.headers),
            "trip": self.trip,
        }


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    turn = Turn(args)
    turn.run(sdk.client(openai, OpenAI, args))
    sys.stdout.write(json.dumps(turn.result()) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
