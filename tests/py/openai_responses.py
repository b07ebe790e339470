#!/usr/bin/env python3
"""One turn against haltd's Responses API (`POST /v1/responses`) with the official OpenAI
Python SDK; prints one JSON line.

The integration tests run this with the interpreter of the venv that `cargo xtask setup`
makes (`HALTD_PYTHON`, with the pinned `openai` SDK) to check that a real OpenAI client sees
haltd's Responses answers, streams and halts as documented in docs/wire-format.md.

Usage (see --help):

    openai_responses.py --base-url http://127.0.0.1:8080/v1 --model builtin --prompt "rivers" \
        --mode stream --max-output-tokens 50 [--instructions TEXT] [--tools JSON|FILE|weather] \
        [--tool-choice auto|none|required|function:NAME|JSON] [--reasoning-effort low] \
        [--input-json JSON|FILE] [--extra-body JSON|FILE] [--previous-response-id ID] \
        [--trip-after K --admin-url URL [--admin-token-file FILE]] [--timeout SECONDS]
    openai_responses.py --base-url URL [common options] --turns JSON|FILE

--base-url ends with /v1, as the SDK's base_url does: the SDK appends /responses. The modes:

    create   client.responses.create(stream=False): one Response
    stream   client.responses.create(stream=True): the raw events, accumulated here
    helper   with client.responses.stream(...) as s: iterate s (the SDK's own accumulation);
             then s.get_final_response() if a response.completed came (the helper raises
             RuntimeError "Didn't receive a `response.completed` event." for any other end,
             an incomplete response included: "final_error" reports the class it raised,
             and the response of the response.incomplete / response.failed event is taken)

--tools takes a list of Responses function tools (or one), inline JSON, a file, or the word
`weather` (get_weather(location, unit), the scripted model's default tool). --input-json takes
the whole `input` array (messages, function_call and function_call_output items) in place of
--prompt. --extra-body is merged into the request body as it is (fields the SDK's signature
lacks, or bad values to see refused).

--turns runs several turns in one process (importing the SDK takes a second or two of CPU): a
JSON array of argument arrays, one per turn, each parsed after the other options, so that a
turn's own options override the common ones. Every turn's arguments are checked before the
first runs; each turn has a client of its own and prints its line as soon as it ended.

--trip-after K POSTs {admin-url}/admin/streams/{stream id}/trip (urllib) once K token frames
were received (K = 0: right after the response head). A token frame is a delta event
(output_text, reasoning_text, reasoning_summary_text, function_call_arguments) or the
`output_item.added` of a function_call item (a call's header, haltd's frame of its own). In
create mode the stream id is not known before the whole answer: the script finds the turn in
GET {admin-url}/admin/streams (the only open batch turn with at least K tokens).

Output, exactly one line of JSON on stdout per turn, every key always present:

    {"ok": bool,                  # no exception was raised
     "mode": str,                 # --mode
     "status": int|null,          # HTTP status (an error: its status_code); null if none
     "response_id": str|null,     # the Response's id (streams: response.created's)
     "model": str|null,
     "response_status": str|null, # the final Response's status: completed, incomplete, failed
                                  # (streams: the response of response.completed /
                                  # .incomplete / .failed; null if none came)
     "incomplete_details": {...}|null,
     "response_error": {...}|null,   # the final Response's `error`
     "store": bool|null,          # the final Response's `store`
     "text": str,                 # streams: the output_text deltas joined; create: the
                                  # output_text parts of the output's messages joined
     "done_text": str|null,       # streams: the response.output_text.done texts joined (null
                                  # if none came); create: null
     "reasoning": str,            # reasoning_text and reasoning_summary_text deltas joined
                                  # (create: the reasoning items' content and summary texts)
     "function_calls": [{"call_id", "name", "arguments"}],  # streams: per output_index, the
                                  # item's call_id and name, the argument deltas joined;
                                  # create: the function_call items
     "output_types": [str],       # the final Response's output items' types (streams: null
                                  # output -> the items the stream opened, in order)
     "usage": {...}|null,         # the final Response's usage
     "events": [str],             # streams: every event's `type`, in order; [] for create
     "sequence_numbers": [int],   # streams: every event's `sequence_number`, in order
     "frames": int,               # streams: token frames seen (see --trip-after); 0 for create
     "halt": any|null,            # the final Response's extra `haltd` member (haltd's halt)
     "headers": {str: str},       # the response's x-haltd-* headers
     "exception": str|null,       # the exception's class name, e.g. "BadRequestError"
     "exception_chain": [str],    # its classes up to Exception
     "body": any|null,            # the error's body (the parsed JSON error object)
     "message": str|null,         # the exception's message
     "trip": {"status", "body", "after_frames", "stream_id", "error"}|null}  # --trip-after

On an exception the other keys keep what was received before it. Exceptions are caught and
reported, whatever their class: the SDK's (`openai.APIStatusError` and its subclasses for an
HTTP error status, `APIError` for an `error` event in the stream, `APIConnectionError` for a
cut connection), its transport's, and any other.

Exit status: 0 whenever a JSON line was printed, including caught exceptions; 2 for usage
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

openai = sdk.require("openai", "openai_responses.py")

MODES = ("create", "stream", "helper")

# The scripted model's default tool, as a Responses function tool.
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather at a place",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
    },
}

DELTAS = {
    "response.output_text.delta": "text",
    "response.reasoning_text.delta": "reasoning",
    "response.reasoning_summary_text.delta": "reasoning",
    "response.function_call_arguments.delta": "arguments",
}

ENDS = ("response.completed", "response.incomplete", "response.failed")

# urllib without proxies from the environment: haltd runs on loopback or in test namespaces.
_URLLIB = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="One turn against haltd's Responses API with the official OpenAI SDK; "
        "prints one JSON line."
    )
    p.add_argument("--base-url", required=True,
                   help="e.g. http://198.18.1.1:8080/v1 (the SDK adds /responses)")
    p.add_argument("--api-key", default="sk-none")
    p.add_argument("--model", default="scripted")
    p.add_argument("--mode", choices=MODES, default="stream")
    p.add_argument("--prompt", default="Tell me about rivers",
                   help="the input, a string (unless --input-json)")
    p.add_argument("--input-json", default=None, metavar="JSON|FILE",
                   help="the whole input array, in place of --prompt")
    p.add_argument("--instructions", default=None)
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument("--tools", default=None, metavar="JSON|FILE|weather",
                   help="Responses function tools: a list, one object, or `weather`")
    p.add_argument("--tool-choice", default=None, metavar="CHOICE",
                   help="auto, none, required, function:NAME, or a JSON object / file")
    p.add_argument("--reasoning-effort", default=None, help='reasoning={"effort": ...}')
    p.add_argument("--previous-response-id", default=None)
    p.add_argument("--extra-body", default=None, metavar="JSON|FILE",
                   help="members merged into the request body as they are")
    p.add_argument("--trip-after", type=int, default=None, metavar="K",
                   help="trip the turn through the admin API after K token frames")
    p.add_argument("--admin-url", default=None, help="e.g. http://198.18.1.1:8081")
    p.add_argument("--admin-token-file", default=None,
                   help="the bearer token of haltd's TCP admin listener")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds, per request [30]")
    p.add_argument("--turns", default=None, metavar="JSON|FILE",
                   help="several turns in one process: a JSON array of argument arrays, each "
                   "parsed after the other options (one output line per turn)")
    a = p.parse_args(argv)
    if a.turns is not None:
        p.error("--turns: not inside a turn's own arguments")
    if a.max_output_tokens is not None and a.max_output_tokens < 1:
        p.error("--max-output-tokens must be >= 1")
    if a.timeout <= 0:
        p.error("--timeout must be > 0")
    if a.trip_after is not None:
        if a.trip_after < 0:
            p.error("--trip-after must be >= 0")
        if not a.admin_url:
            p.error("--trip-after needs --admin-url")
    if a.tools is not None:
        if a.tools == "weather":
            a.tools = [WEATHER_TOOL]
        else:
            a.tools = sdk.json_arg(p, "--tools", a.tools)
        if isinstance(a.tools, dict):
            a.tools = [a.tools]
        if not isinstance(a.tools, list):
            p.error("--tools: a JSON list of tools, or one tool object")
    if a.tool_choice is not None:
        c = a.tool_choice
        if c in ("auto", "none", "required"):
            pass
        elif c.startswith("function:") and len(c) > len("function:"):
            a.tool_choice = {"type": "function", "name": c[len("function:"):]}
        else:
            a.tool_choice = sdk.json_arg(p, "--tool-choice", c)
            if not isinstance(a.tool_choice, dict):
                p.error("--tool-choice: auto, none, required, function:NAME or a JSON object")
    if a.input_json is not None:
        a.input_json = sdk.json_arg(p, "--input-json", a.input_json)
        if not isinstance(a.input_json, list):
            p.error("--input-json: a JSON array of input items")
    if a.extra_body is not None:
        a.extra_body = sdk.json_arg(p, "--extra-body", a.extra_body)
        if not isinstance(a.extra_body, dict):
            p.error("--extra-body: a JSON object")
    return a








dump, extra, json_or_text = sdk.dump, sdk.extra, sdk.json_or_text


class Turn:
    """What one turn produced; `result()` is the JSON line."""

    def __init__(self, args):
        self.args = args
        self.status = None
        self.response_id = None
        self.model = None
        self.final = None  # the final Response (a model)
        self.final_error = None  # helper mode: what get_final_response() raised, if called
        self.text = []
        self.done_text = None
        self.reasoning = []
        self.calls = {}  # output_index -> {"call_id", "name", "arguments"}
        self.opened = []  # output item types the stream opened, in order
        self.events = []
        self.sequence_numbers = []
        self.frames = 0
        self.headers = {}
        self.error = None
        self.trip = None
        self.tripped = False
        if args.trip_after is not None:
            self.trip = {"status": None, "body": None, "after_frames": None,
                         "stream_id": None, "error": "not tripped: the turn ended before it"}

    # -- requests ----------------------------------------------------------------------

    def request_kwargs(self):
        a = self.args
        kw = {"model": a.model, "input": a.input_json if a.input_json is not None else a.prompt}
        if a.instructions is not None:
            kw["instructions"] = a.instructions
        if a.max_output_tokens is not None:
            kw["max_output_tokens"] = a.max_output_tokens
        if a.tools is not None:
            kw["tools"] = a.tools
        if a.tool_choice is not None:
            kw["tool_choice"] = a.tool_choice
        if a.reasoning_effort is not None:
            kw["reasoning"] = {"effort": a.reasoning_effort}
        if a.previous_response_id is not None:
            kw["previous_response_id"] = a.previous_response_id
        if a.extra_body is not None:
            kw["extra_body"] = a.extra_body
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
                self.run_helper(client)
        except Exception as e:  # noqa: BLE001 - every exception is an outcome to report
            self.caught(e)

    def caught(self, e):
        response = getattr(e, "response", None)
        if response is not None and not self.headers:
            self.take_response(response)
        if isinstance(e, openai.APIStatusError):
            self.status = e.status_code
        message = getattr(e, "message", None) or str(e)
        cause = e.__cause__
        if isinstance(e, openai.APIConnectionError) and cause is not None \
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
        tripper = None
        if self.args.trip_after is not None:
            tripper = self.start_batch_tripper()
        try:
            raw = client.responses.with_raw_response.create(**self.request_kwargs())
        finally:
            if tripper is not None:
                tripper[0].set()
                tripper[1].join(self.args.timeout)
        self.take_response(raw.http_response)
        response = raw.parse()
        self.take_final(response)
        for item in response.output or []:
            if item.type == "message":
                for part in item.content or []:
                    if part.type == "output_text":
                        self.text.append(part.text)
            elif item.type == "reasoning":
                for part in (getattr(item, "content", None) or []):
                    self.reasoning.append(part.text)
                for part in item.summary or []:
                    self.reasoning.append(part.text)
            elif item.type == "function_call":
                self.calls[len(self.calls)] = {
                    "call_id": item.call_id, "name": item.name, "arguments": item.arguments}

    def run_stream(self, client):
        with client.responses.with_streaming_response.create(
                stream=True, **self.request_kwargs()) as r:
            self.take_response(r.http_response)
            self.maybe_trip()
            for event in r.parse():
                self.take_event(event)

    def run_helper(self, client):
        with client.responses.stream(**self.request_kwargs()) as s:
            self.take_response(getattr(s, "_response", None))
            self.maybe_trip()
            for event in s:
                self.take_event(event)
            if "response.completed" in self.events:
                self.take_final(s.get_final_response())
            else:
                # What a client of the helper meets on any other end: reported, so that the
                # tests check the documented behaviour.
                try:
                    s.get_final_response()
                except Exception as e:  # noqa: BLE001 - any class is the outcome reported
                    self.final_error = type(e).__name__

    # -- what was received -------------------------------------------------------------

    def take_final(self, response):
        self.final = response
        self.response_id = response.id
        self.model = response.model

    def take_event(self, event):
        t = event.type
        self.events.append(t)
        self.sequence_numbers.append(getattr(event, "sequence_number", None))
        if t == "response.created":
            self.response_id = event.response.id
            self.model = event.response.model
        elif t == "response.output_item.added":
            item = event.item
            self.opened.append(item.type)
            if item.type == "function_call":
                self.calls[event.output_index] = {
                    "call_id": item.call_id, "name": item.name, "arguments": ""}
                self.frames += 1
        elif t in DELTAS:
            kind = DELTAS[t]
            if kind == "text":
                self.text.append(event.delta)
            elif kind == "reasoning":
                self.reasoning.append(event.delta)
            else:
                call = self.calls.setdefault(
                    event.output_index, {"call_id": None, "name": None, "arguments": ""})
                call["arguments"] += event.delta
            self.frames += 1
        elif t == "response.output_text.done":
            self.done_text = (self.done_text or "") + event.text
        elif t in ENDS:
            self.take_final(event.response)
        self.maybe_trip()

    # -- trips -------------------------------------------------------------------------

    def admin_headers(self):
        if not self.args.admin_token_file:
            return {}
        with open(self.args.admin_token_file) as f:
            return {"authorization": "Bearer " + f.read().strip()}

    def maybe_trip(self):
        k = self.args.trip_after
        if k is not None and not self.tripped and self.frames >= k:
            self.trip_now(self.headers.get("x-haltd-stream-id"))

    def trip_now(self, stream_id):
        self.tripped = True
        self.trip = {"status": None, "body": None, "after_frames": self.frames,
                     "stream_id": stream_id, "error": None}
        if not stream_id:
            self.trip["error"] = "no x-haltd-stream-id header: cannot trip"
            return
        url = "%s/admin/streams/%s/trip" % (self.args.admin_url.rstrip("/"), stream_id)
        headers = self.admin_headers()
        # haltd refuses admin POSTs that are not JSON, whatever their body.
        headers["content-type"] = "application/json"
        req = urllib.request.Request(url, data=b"", headers=headers, method="POST")
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
        """create mode: find the held batch turn in the admin API and trip it at K tokens."""
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
                    self.trip["after_frames"] = None
                    return
                time.sleep(0.002)
            self.trip = {"status": None, "body": None, "after_frames": None,
                         "stream_id": None, "error": "not tripped: " + last}

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        return done, t

    # -- the line ----------------------------------------------------------------------

    def result(self):
        f = self.final
        error = self.error or {}
        output = (getattr(f, "output", None) if f is not None else None)
        if output is not None and (output or self.args.mode == "create"):
            output_types = [item.type for item in output]
        else:
            output_types = list(self.opened)
        return {
            "ok": self.error is None,
            "mode": self.args.mode,
            "status": self.status,
            "response_id": self.response_id,
            "model": self.model,
            "response_status": getattr(f, "status", None),
            "incomplete_details": dump(getattr(f, "incomplete_details", None)),
            "response_error": dump(getattr(f, "error", None)),
            "store": getattr(f, "store", None),
            "text": "".join(self.text),
            "done_text": self.done_text,
            "reasoning": "".join(self.reasoning),
            "function_calls": [self.calls[i] for i in sorted(self.calls)],
            "output_types": output_types,
            "usage": dump(getattr(f, "usage", None)),
            "events": self.events,
            "sequence_numbers": self.sequence_numbers,
            "frames": self.frames,
            "halt": extra(f, "haltd") if f is not None else None,
            "headers": self.headers,
            "exception": error.get("exception"),
            "exception_chain": error.get("exception_chain", []),
            "body": error.get("body"),
            "message": error.get("message"),
            "trip": self.trip,
            "final_error": self.final_error,
        }


def main(argv=None):
    argvs = sdk.turn_argvs(sys.argv[1:] if argv is None else argv, "openai_responses.py")
    # Every turn's arguments are checked before the first one runs.
    turns = [parse_args(a) for a in argvs]
    for args in turns:
        turn = Turn(args)
        turn.run(sdk.client(openai, openai.OpenAI, args))
        sys.stdout.write(json.dumps(turn.result()) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
