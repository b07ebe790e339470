#!/usr/bin/env python3
"""An agent loop of the OpenAI Agents SDK (`openai-agents`, imported as `agents`) against
haltd's Responses API with TokenCircuit on; prints one JSON line per run.

The agent is an `agents.Agent` with `function_tool`s, run by `Runner.run_streamed` (or
`Runner.run`) with the SDK's default Responses model: `OpenAIResponsesModel` over an
`AsyncOpenAI` client whose base URL is haltd's (`set_default_openai_client`), as the SDK's
own docs set up a compatible server. Tracing is off (`set_tracing_disabled(True)`): nothing
leaves the test namespaces. The client keeps the SDK's default retries, as an application's
does, so a run shows what an agent meets, retries included.

The tools are executed here, by the agent; their results are scripted per tool by the
scenario, so the loop is one of spec 002's: the model keeps calling a tool that keeps
failing. The model is the scripted upstream behind haltd; a `[[script:...]]` directive per
turn says what it does (call a tool, or answer in text).

Usage:

    openai_agents_loop.py --base-url http://198.18.1.1:8080/v1 --scenario JSON|FILE \
        [--conversation-id ID] [--mode stream|run] [--max-turns 8] [--model scripted]
    openai_agents_loop.py --base-url URL [common options] --turns JSON|FILE

--base-url ends with /v1 (the SDK adds /responses). --turns runs several agent runs in one
process (importing the Agents SDK takes two seconds of CPU): a JSON array of argument arrays,
one per run, each parsed after the common options (`sdk.turn_argvs`); one line per run.

The scenario:

    {"tools": {"NAME": [RESULT, ...]},   # the tools the agent has (below), and what each
                                         # call of NAME does, in order (the last repeats):
                                         #   "text"                     returned
                                         #   {"content": str, "effect": bool}  returned; the
                                         #        call changed something (an order created)
                                         #   {"raise": str}             the tool raises with
                                         #        that message: the SDK's default
                                         #        failure_error_function gives the model its
                                         #        fixed "An error occurred while running the
                                         #        tool. Please try again." (no class, no message)
     "model": [DIRECTIVE, ...]}          # the model's move per turn (the last repeats)

The first directive is the user's input. Before each later model call the run's
`call_model_input_filter` (`RunConfig`) appends a user message with that turn's directive, so
the tool results go out as the tools wrote them (the filter changes what is sent, not the
agent's history). --conversation-id is sent as `x-haltd-conversation-id` with every request.

The tools (`function_tool`s, with the parameters the scripted model's calls carry):
run_sql(namespace, q), book_meeting(room, slot), get_weather(location, unit="celsius"),
search_orders(customer), count_orders(customer), create_order(sku, qty), get_order(sku).

Output, one line of JSON per run, every key always present:

    {"mode": str,
     "requests": [{"status": int, "stream_id": str|null, "halted": str|null}],
                                   # every HTTP response the SDK got (an httpx response hook):
                                   # its status, x-haltd-stream-id and x-haltd-halted headers;
                                   # a retry of the SDK's own is one more entry
     "responses": [{"id", "events": [str], "times": [float], "function_calls": [{"call_id",
                    "name", "arguments"}], "text": str, "status": str|null, "haltd": any|null}],
                                   # stream mode: per model response, the raw events' types in
                                   # order and when each came (monotonic ms), every function call any event carried (its item's
                                   # call_id and name, the argument deltas joined, or the
                                   # item's arguments when no delta came), the output text,
                                   # the final status and the final response's `haltd` member
                                   # (haltd's halt object); [] in run mode
     "tool_calls": [{"name", "arguments"}],   # the calls the agent executed, in order
     "tools_executed": int, "executed": {NAME: int}, "effects": {NAME: int},
     "final_output": str|null,     # the run's final output, when it ended normally
     "exception": {"class", "chain", "message", "status_code", "body"}|null}
                                   # what ended the run: the SDK's exception (`chain`: its
                                   # classes up to Exception; `status_code` and `body` for an
                                   # HTTP error)

Exit status: 0 whenever the lines were printed; 2 for usage errors; 1 for a crash.
"""

import argparse
import asyncio
import json
import sys
import time

import sdk

openai = sdk.require("openai", "openai_agents_loop.py")
agents = sdk.require("agents", "openai_agents_loop.py")

from agents import (  # noqa: E402 - imported once `sdk.require` said it is there
    Agent,
    RunConfig,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.run_config import ModelInputData  # noqa: E402


class Run:
    """One agent run: the scenario's state and what the run produced."""

    def __init__(self, args, scenario):
        self.args = args
        self.scenario = scenario
        self.requests = []
        self.responses = []
        self.tool_calls = []
        self.executed = {}
        self.effects = {}
        self.final_output = None
        self.exception = None

    # -- the tools ---------------------------------------------------------------------

    def call(self, name, arguments):
        """Executes the scripted call `name(arguments)`: its result, or a raise."""
        self.tool_calls.append({"name": name, "arguments": json.dumps(arguments)})
        n = self.executed.get(name, 0)
        self.executed[name] = n + 1
        results = self.scenario["tools"].get(name) or ["unknown tool"]
        result = results[min(n, len(results) - 1)]
        if isinstance(result, str):
            return result
        if result.get("effect"):
            self.effects[name] = self.effects.get(name, 0) + 1
        if "raise" in result:
            raise RuntimeError(result["raise"])
        return result["content"]

    def tools(self):
        """The scenario's tools, as `function_tool`s that call [`Run.call`]."""
        run = self

        @function_tool
        def run_sql(namespace: str, q: str) -> str:
            """Run a SQL query in a namespace."""
            return run.call("run_sql", {"namespace": namespace, "q": q})

        @function_tool
        def book_meeting(room: str, slot: str) -> str:
            """Book a meeting room for a time slot (HH:MM, 24 h)."""
            return run.call("book_meeting", {"room": room, "slot": slot})

        @function_tool
        def get_weather(location: str, unit: str = "celsius") -> str:
            """Get the current weather in a city."""
            return run.call("get_weather", {"location": location, "unit": unit})

        @function_tool
        def search_orders(customer: str) -> str:
            """Search a customer's orders."""
            return run.call("search_orders", {"customer": customer})

        @function_tool
        def count_orders(customer: str) -> str:
            """Count a customer's orders (the verifier of search_orders)."""
            return run.call("count_orders", {"customer": customer})

        @function_tool
        def create_order(sku: str, qty: int) -> str:
            """Create an order."""
            return run.call("create_order", {"sku": sku, "qty": qty})

        @function_tool
        def get_order(sku: str) -> str:
            """Look an order up (the verifier of create_order)."""
            return run.call("get_order", {"sku": sku})

        every = {t.name: t for t in (run_sql, book_meeting, get_weather, search_orders,
                                     count_orders, create_order, get_order)}
        unknown = sorted(set(self.scenario["tools"]) - set(every))
        if unknown:
            raise SystemExit("openai_agents_loop.py: unknown tools %s" % unknown)
        return [every[name] for name in self.scenario["tools"]]

    # -- the model's moves -------------------------------------------------------------

    def directive(self, turn):
        moves = self.scenario["model"]
        return moves[min(turn, len(moves) - 1)]

    def input_filter(self):
        """The `call_model_input_filter`: turn n > 0 gets the user message of directive n."""
        turns = {"n": 0}

        def add_directive(data):
            n = turns["n"]
            turns["n"] = n + 1
            items = list(data.model_data.input)
            if n > 0:
                items.append({"role": "user", "content": self.directive(n)})
            return ModelInputData(input=items, instructions=data.model_data.instructions)

        return add_directive

    # -- what the SDK saw --------------------------------------------------------------

    async def on_response(self, response):
        self.requests.append({
            "status": response.status_code,
            "stream_id": response.headers.get("x-haltd-stream-id"),
            "halted": response.headers.get("x-haltd-halted"),
        })

    def take_raw(self, event):
        """A raw Responses event of the stream (`RawResponsesStreamEvent.data`)."""
        t = event.type
        if t == "response.created" or not self.responses:
            self.responses.append({"id": None, "events": [], "times": [], "calls": {},
                                   "text": [], "status": None, "haltd": None})
        r = self.responses[-1]
        r["events"].append(t)
        r["times"].append(round(time.monotonic() * 1000, 3))
        if t == "response.created":
            r["id"] = event.response.id
        elif t in ("response.output_item.added", "response.output_item.done"):
            item = event.item
            if item.type == "function_call":
                c = r["calls"].setdefault(event.output_index, {
                    "call_id": item.call_id, "name": item.name, "arguments": "",
                    "deltas": False})
                if t.endswith(".done") and not c["deltas"]:
                    c["arguments"] = item.arguments
        elif t == "response.function_call_arguments.delta":
            c = r["calls"].setdefault(event.output_index, {
                "call_id": None, "name": None, "arguments": "", "deltas": False})
            c["arguments"] += event.delta
            c["deltas"] = True
        elif t == "response.output_text.delta":
            r["text"].append(event.delta)
        elif t in ("response.completed", "response.incomplete", "response.failed"):
            r["status"] = event.response.status
            r["haltd"] = sdk.extra(event.response, "haltd")
            # A call the final response holds that no event opened (none, from haltd).
            for i, item in enumerate(event.response.output or []):
                if item.type == "function_call" and i not in r["calls"]:
                    r["calls"][i] = {"call_id": item.call_id, "name": item.name,
                                     "arguments": item.arguments, "deltas": False}

    def caught(self, e):
        self.exception = {
            "class": type(e).__name__,
            "chain": sdk.exception_chain(e),
            "message": str(e),
            "status_code": getattr(e, "status_code", None),
            "body": getattr(e, "body", None),
        }

    # -- the run -----------------------------------------------------------------------

    async def run(self):
        a = self.args
        headers = {"x-haltd-conversation-id": a.conversation_id} if a.conversation_id else None
        http = openai.DefaultAsyncHttpxClient(
            trust_env=False, event_hooks={"response": [self.on_response]})
        client = openai.AsyncOpenAI(base_url=a.base_url, api_key=a.api_key,
                                    default_headers=sdk.tenant_headers(a.api_key, headers),
                                    http_client=http,
                                    timeout=a.timeout)
        set_default_openai_client(client, use_for_tracing=False)
        agent = Agent(name="assistant", instructions="You help with the user's task.",
                      model=a.model, tools=self.tools())
        config = RunConfig(call_model_input_filter=self.input_filter())
        first = self.directive(0)
        try:
            if a.mode == "stream":
                result = Runner.run_streamed(agent, first, max_turns=a.max_turns,
                                             run_config=config)
                async for ev in result.stream_events():
                    if ev.type == "raw_response_event":
                        self.take_raw(ev.data)
            else:
                result = await Runner.run(agent, first, max_turns=a.max_turns,
                                          run_config=config)
            self.final_output = None if result.final_output is None else str(
                result.final_output)
        except Exception as e:  # noqa: BLE001 - every exception is an outcome to report
            self.caught(e)
        finally:
            await client.close()

    def result(self):
        responses = []
        for r in self.responses:
            calls = [{k: c[k] for k in ("call_id", "name", "arguments")}
                     for _, c in sorted(r["calls"].items())]
            responses.append({"id": r["id"], "events": r["events"], "times": r["times"],
                              "function_calls": calls,
                              "text": "".join(r["text"]), "status": r["status"],
                              "haltd": r["haltd"]})
        return {
            "mode": self.args.mode,
            "requests": self.requests,
            "responses": responses,
            "tool_calls": self.tool_calls,
            "tools_executed": len(self.tool_calls),
            "executed": self.executed,
            "effects": self.effects,
            "final_output": self.final_output,
            "exception": self.exception,
        }


def parse_args(argv):
    p = argparse.ArgumentParser(prog="openai_agents_loop.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="e.g. http://198.18.1.1:8080/v1")
    p.add_argument("--api-key", default="sk-agents")
    p.add_argument("--model", default="scripted")
    p.add_argument("--scenario", required=True, metavar="JSON|FILE")
    p.add_argument("--conversation-id", help="sent as x-haltd-conversation-id")
    p.add_argument("--mode", choices=["stream", "run"], default="stream",
                   help="Runner.run_streamed or Runner.run")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds, per request [30]")
    a = p.parse_args(argv)
    a.scenario = sdk.json_arg(p, "--scenario", a.scenario)
    sc = a.scenario
    if not (isinstance(sc, dict) and isinstance(sc.get("tools"), dict)
            and isinstance(sc.get("model"), list) and sc["model"]
            and all(isinstance(m, str) for m in sc["model"])):
        p.error("--scenario: {\"tools\": {NAME: [RESULT, ...]}, \"model\": [DIRECTIVE, ...]}")
    if a.max_turns < 1:
        p.error("--max-turns must be >= 1")
    return a


def main(argv=None):
    argvs = sdk.turn_argvs(sys.argv[1:] if argv is None else argv, "openai_agents_loop.py")
    runs = [parse_args(a) for a in argvs]
    set_tracing_disabled(True)
    for args in runs:
        run = Run(args, args.scenario)
        asyncio.run(run.run())
        sys.stdout.write(json.dumps(run.result()) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
