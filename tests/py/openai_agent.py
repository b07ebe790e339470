#!/usr/bin/env python3
"""A real agent loop with the official OpenAI Python SDK's tool calling, against haltd with
TokenCircuit on; prints one JSON line.

The tool `get_weather` is executed here, by the agent, and always fails with the error
given by --tool-error, so the loop is the one spec 002 is about: the model keeps calling a
tool that keeps failing. The model is the scripted upstream: every tool result carries
--next (a `[[script:...]]` directive) so that the model calls the tool again. The loop
stops when the model answers without a tool call, when the SDK raises (haltd's halt in the
stream, or its answer without the model), or after --max-turns.

Usage:

    openai_agent.py --base-url http://198.18.1.1:8080/v1 \
        --tool-error "PermissionError: ..." [--next "[[script:tool_call tokens=1]]"] \
        [--stream/--no-stream] [--max-turns 6]

Output, one line of JSON:

    {"turns": [{"tool_calls": [{"id", "name", "arguments"}], "content": str,
                "finish_reason": str|null}],      # each answer the model gave
     "tools_executed": int,                         # tool calls the agent ran
     "error": {"class", "status_code", "body", "message"}|null}   # what ended the loop

With --scenario FILE (the loops of `bench-tool-circuit`) the tools and the model's moves
come from a JSON file instead:

    {"tools": {"NAME": [RESULT, ...]},   # what each call of NAME returns, in order (the
                                         # last one repeats); RESULT is a string, or
                                         # {"content": str, "effect": bool}: the call
                                         # changed something (an order was created)
     "model": [DIRECTIVE, ...]}          # the model's move per turn (the last repeats)

The first directive is the user's message; after each turn's tool results the agent adds a
user message with the next one, so the results stay as the tool wrote them. The output then
also has "executed" and "effects" ({NAME: count}); --conversation-id sends
`x-haltd-conversation-id`.

--history says how the agent keeps its history (scenario loops only):
  full      every message, and the loop ends at haltd's first refusal (the default);
  trim      only the first user message and the newest tool exchange (older calls and
            results dropped); after a refusal, only the first user message: the agent
            carries on, as agents that reset their context on an error do;
  flatten   older tool exchanges rewritten as text (the call as an assistant message,
            the result as a user message), the newest one kept structured; after a
            refusal, every exchange as text, and the agent carries on.
The output then also has "refusals": how many requests haltd refused or halted.

Exit status: 0 whenever the line was printed; 1 for a crash.
"""

import argparse
import json
import sys

import sdk

openai = sdk.require("openai", "openai_agent.py")
OpenAI = openai.OpenAI

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default="scripted")
    p.add_argument("--tool-error", help="what every get_weather call returns")
    p.add_argument("--scenario", help="JSON file: the tools' results and the model's moves")
    p.add_argument("--conversation-id", help="sent as x-haltd-conversation-id")
    p.add_argument("--next", default="[[script:tool_call tokens=1]]",
                   help="directive appended to each tool result (the model's next answer)")
    p.add_argument("--first", default="[[script:tool_call tokens=1]]",
                   help="the user's message (the model's first answer)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--history", choices=["full", "trim", "flatten"], default="full")
    return p.parse_args(argv)


def one_turn(client, args, messages, tools=(WEATHER_TOOL,)):
    """One model answer: (content, tool calls as dicts, finish_reason)."""
    kw = dict(model=args.model, messages=messages, tools=list(tools), timeout=30)
    if not args.stream:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in (msg.tool_calls or [])]
        return msg.content or "", calls, r.choices[0].finish_reason
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        if ch.delta.content:
            content.append(ch.delta.content)
        for tc in ch.delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                c["id"] = tc.id
            if tc.function and tc.function.name:
                c["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
        if ch.finish_reason:
            finish = ch.finish_reason
    return "".join(content), [calls[i] for i in sorted(calls)], finish


def nth(items, i):
    """The i-th item, the last one past the end."""
    return items[min(i, len(items) - 1)]


def as_text(messages):
    """The messages with every tool exchange rewritten as text."""
    names, out = {}, []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            said = []
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
                said.append("I called %s(%s)." % (c["function"]["name"], c["function"]["arguments"]))
            out.append({"role": "assistant", "content": " ".join(said)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": "%s returned: %s" % (
                names.get(m["tool_call_id"], "a tool"), m["content"])})
        else:
            out.append(m)
    return out


def newest_exchange(messages):
    """The index of the newest assistant message with tool calls (1 when none: nothing older
    to drop)."""
    for i in range(len(messages) - 1, 0, -1):
        if messages[i]["role"] == "assistant" and messages[i].get("tool_calls"):
            return i
    return 1


def shaped(history, messages, refused):
    """What the agent sends, by --history (see the module's doc)."""
    if history == "full":
        return messages
    first, newest = messages[:1], newest_exchange(messages)
    if history == "trim":
        return first + ([] if refused else messages[newest:])
    older = as_text(messages[1:newest]) if not refused else as_text(messages[1:])
    return first + older + ([] if refused else messages[newest:])


def run_scenario(client, args):
    """The loop of a --scenario file (see the module's doc)."""
    with open(args.scenario) as f:
        sc = json.load(f)
    tools = [{"type": "function", "function": {
        "name": name, "description": "A tool of the scenario.",
        "parameters": {"type": "object"}}} for name in sc["tools"]]
    messages = [{"role": "user", "content": sc["model"][0]}]
    out = {"turns": [], "tools_executed": 0, "executed": {}, "effects": {}, "error": None,
           "refusals": 0}
    refused = False
    try:
        for turn in range(args.max_turns):
            try:
                sent = shaped(args.history, messages, refused)
                if refused:
                    messages = sent + [{"role": "user", "content": nth(sc["model"], turn)}]
                    sent = messages
                content, calls, finish = one_turn(client, args, sent, tools)
                refused = False
            except openai.APIError:
                if args.history == "full":
                    raise
                out["refusals"] += 1
                refused = True
                continue
            out["turns"].append({"tool_calls": calls, "content": content,
                                 "finish_reason": finish})
            if not calls:
                break
            messages.append({"role": "assistant", "content": content or None, "tool_calls": [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]})
            for c in calls:
                n = out["executed"].get(c["name"], 0)
                result = nth(sc["tools"].get(c["name"]) or ["unknown tool"], n)
                if isinstance(result, str):
                    result = {"content": result}
                out["executed"][c["name"]] = n + 1
                out["tools_executed"] += 1
                if result.get("effect"):
                    out["effects"][c["name"]] = out["effects"].get(c["name"], 0) + 1
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": result["content"]})
            messages.append({"role": "user", "content": nth(sc["model"], turn + 1)})
    except openai.APIError as e:
        out["error"] = {"class": type(e).__name__,
                        "status_code": getattr(e, "status_code", None),
                        "body": getattr(e, "body", None), "message": str(e)}
    return out


def main(argv):
    args = parse_args(argv)
    headers = {"x-haltd-conversation-id": args.conversation_id} if args.conversation_id else None
    client = OpenAI(base_url=args.base_url, api_key="sk-agent", max_retries=0,
                    default_headers=sdk.tenant_headers("sk-agent", headers))
    if args.scenario:
        print(json.dumps(run_scenario(client, args)))
        return 0
    if args.tool_error is None:
        sys.stderr.write("openai_agent.py: --tool-error or --scenario is needed\n")
        return 2
    messages = [{"role": "user", "content": args.first}]
    out = {"turns": [], "tools_executed": 0, "error": None}
    try:
        for _ in range(args.max_turns):
            content, calls, finish = one_turn(client, args, messages)
            out["turns"].append({"tool_calls": calls, "content": content,
                                 "finish_reason": finish})
            if not calls:
                break
            messages.append({"role": "assistant", "content": content or None, "tool_calls": [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]})
            for c in calls:
                out["tools_executed"] += 1
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": "%s %s" % (args.tool_error, args.next)})
    except openai.APIError as e:
        out["error"] = {"class": type(e).__name__,
                        "status_code": getattr(e, "status_code", None),
                        "body": getattr(e, "body", None), "message": str(e)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
