#!/usr/bin/env python3
"""Many streamed turns with ONE official OpenAI Python SDK client; prints one JSON line.

The keep-alive test (tests/tests/it/keepalive.rs) runs this with the venv's interpreter
(`HALTD_PYTHON`) to check that the SDK's connection pool reuses one connection to haltd from
turn to turn, that a trip closes that connection, and that the SDK goes on with a new one.

Usage:

    openai_keepalive.py --base-url http://198.18.1.1:8080/v1 --turns 50 \
        [--trip-turn 30 --trip-after 3 --admin-url http://198.18.1.1:8081 \
         --admin-token-file FILE] [--max-tokens 8] [--ca-file CA.pem]

Every turn is a streamed chat turn of the built-in model (`ignore_eos`, so it produces
--max-tokens tokens; the tripped turn asks for 100000, so it is still running when the trip
lands). On turn --trip-turn the script POSTs {admin-url}/admin/streams/{id}/trip after
--trip-after token chunks. The SDK client is made once, with the SDK's own HTTP client and
max_retries=0, so a turn that needed a retry shows as an error. With an `https://` base URL,
--ca-file is the CA the client trusts (haltd's test certificate, `--tls-cert`), instead of
the system's.

It uses the SDK's async client: after `[DONE]` it reads the rest of an HTTP/1.1 response
("HTTP/1.1 needs the remaining body consumed for connection reuse", openai/_streaming.py), so
its pool keeps the connection. The sync client of the pinned SDK stops reading at `[DONE]`
and closes the response before the end of the chunked body, which discards the connection
whatever the server does.

Output, one line of JSON:

    {"turns": [{"turn": int,             # 1-based
                "local_port": int|null,  # the client's port of the connection the turn used
                "stream_id": str|null,
                "chunks": int, "finish_reason": str|null,
                "error": {"class": str, "message": str, "body": any}|null,
                "trip_status": int|null}, ...]}
"""

import argparse
import asyncio
import json
import ssl
import sys
import urllib.error
import urllib.request

import openai
from openai import AsyncOpenAI

import sdk

_URLLIB = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--trip-turn", type=int, default=None)
    p.add_argument("--trip-after", type=int, default=3)
    p.add_argument("--admin-url", default=None)
    p.add_argument("--admin-token-file", default=None)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--ca-file", default=None)
    a = p.parse_args(argv)
    if a.trip_turn is not None and not a.admin_url:
        p.error("--trip-turn needs --admin-url")
    return a


def trip(args, stream_id):
    """POSTs the admin trip of `stream_id`; returns the HTTP status (None on a transport error)."""
    headers = {"content-type": "application/json"}
    if args.admin_token_file:
        with open(args.admin_token_file) as f:
            headers["authorization"] = "Bearer " + f.read().strip()
    url = "%s/admin/streams/%s/trip" % (args.admin_url.rstrip("/"), stream_id)
    req = urllib.request.Request(url, data=b"", headers=headers, method="POST")
    try:
        with _URLLIB.open(req, timeout=args.timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def local_port(http_response):
    """The client's port of the connection a response came on (httpcore's network stream)."""
    stream = http_response.extensions.get("network_stream")
    if stream is None:
        return None
    addr = stream.get_extra_info("client_addr")
    return addr[1] if addr else None


async def one_turn(args, client, n):
    tripping = n == args.trip_turn
    out = {"turn": n, "local_port": None, "stream_id": None, "chunks": 0,
           "finish_reason": None, "error": None, "trip_status": None}
    kw = {
        "model": "builtin",
        "messages": [{"role": "user", "content": "Tell me about rivers, turn %d" % n}],
        "max_tokens": 100000 if tripping else args.max_tokens,
        "stream": True,
        "extra_body": {"ignore_eos": True},
    }
    try:
        async with client.chat.completions.with_streaming_response.create(**kw) as r:
            out["local_port"] = local_port(r.http_response)
            out["stream_id"] = r.headers.get("x-haltd-stream-id")
            async for chunk in await r.parse():
                for choice in chunk.choices or []:
                    if choice.finish_reason is not None:
                        out["finish_reason"] = choice.finish_reason
                    else:
                        out["chunks"] += 1
                if tripping and out["trip_status"] is None and out["chunks"] >= args.trip_after:
                    # A blocking POST: the stream waits meanwhile, as any slow consumer's.
                    out["trip_status"] = trip(args, out["stream_id"])
    except (openai.OpenAIError, OSError) as e:
        out["error"] = {"class": type(e).__name__, "message": getattr(e, "message", str(e)),
                        "body": getattr(e, "body", None)}
    return out


async def run(args):
    http = {"trust_env": False}
    if args.ca_file:
        http["verify"] = ssl.create_default_context(cafile=args.ca_file)
    client = AsyncOpenAI(
        base_url=args.base_url,
        api_key="sk-keepalive",
        default_headers=sdk.tenant_headers("sk-keepalive"),
        timeout=args.timeout,
        max_retries=0,  # a turn that needed a retry shows as an error
        http_client=openai.DefaultAsyncHttpxClient(**http),
    )
    async with client:
        return [await one_turn(args, client, n) for n in range(1, args.turns + 1)]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    turns = asyncio.run(run(args))
    sys.stdout.write(json.dumps({"turns": turns}) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
