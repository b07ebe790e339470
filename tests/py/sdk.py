"""The SDK a test client drives, imported with a clear message when it is missing.

The clients run with the venv python that `cargo xtask setup` makes, where the pinned SDKs
are installed; any other python most likely lacks them, and says so here rather than with a
traceback.
"""

import argparse
import importlib
import json
import os
import sys


def require(module, script):
    """Imports `module` (an SDK, e.g. "openai") for `script` (the client's file name), or
    exits with status 1 and a line on stderr naming both."""
    try:
        return importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - environment problem
        sys.stderr.write(
            "%s: cannot import the %s SDK (%s); run it with the venv python that "
            "`cargo xtask setup` makes (~/.local/share/haltd/venv/bin/python)\n"
            % (script, module, e)
        )
        sys.exit(1)


# The header by which the test harness names each request's tenant, as a trusted gateway
# would (tests/src/daemon.rs TEST_TENANT_HEADER): haltd started by the harness keys degraded
# mode on it, so that each API key of a test is its own scope. A haltd without
# `--identity-header x-haltd-test-tenant` ignores it.
TENANT_HEADER = "x-haltd-test-tenant"


def tenant_headers(api_key, extra=None):
    """The tenant header of `api_key` ("Bearer KEY", as the Rust clients send it), with
    `extra` headers."""
    headers = dict(extra or {})
    headers[TENANT_HEADER] = "Bearer %s" % api_key
    return headers


def client(sdk, cls, args):
    """A client of `sdk`'s class `cls` for one test run's `args` (base_url, api_key, timeout):
    one request per turn, since the tests count turns and streams (max_retries=0), and no
    proxies from the environment."""
    return cls(
        base_url=args.base_url,
        api_key=args.api_key,
        timeout=args.timeout,
        max_retries=0,
        default_headers=tenant_headers(args.api_key),
        http_client=sdk.DefaultHttpxClient(trust_env=False),
    )


def json_arg(p, name, value):
    """Inline JSON (starting with "[" or "{") or the path of a JSON file, for option `name` of
    parser `p` (a usage error if it is neither)."""
    text = value.strip()
    if not text.startswith(("[", "{")):
        if not os.path.isfile(value):
            p.error("%s: neither inline JSON nor a file: %r" % (name, value))
        with open(value) as f:
            text = f.read()
    try:
        return json.loads(text)
    except ValueError as e:
        p.error("%s: not JSON: %s" % (name, e))


def turn_argvs(argv, prog):
    """The argument lists of the turns a client runs: `argv` itself, or with `--turns SPEC`
    (a JSON array, inline or a file, of one array of arguments per turn) the other arguments
    followed by each turn's own, so that a turn's own options override the common ones."""
    at = [i for i, a in enumerate(argv) if a == "--turns" or a.startswith("--turns=")]
    if not at:
        return [argv]
    p = argparse.ArgumentParser(prog=prog)
    if len(at) > 1:
        p.error("--turns: given twice")
    i = at[0]
    if argv[i].startswith("--turns="):
        spec, rest = argv[i][len("--turns="):], argv[i + 1:]
    elif i + 1 < len(argv):
        spec, rest = argv[i + 1], argv[i + 2:]
    else:
        p.error("--turns: expected one argument")
    turns = json_arg(p, "--turns", spec)
    if not isinstance(turns, list) or not turns or not all(
            isinstance(t, list) and all(isinstance(x, str) for x in t) for t in turns):
        p.error("--turns: a non-empty JSON array of arrays of strings")
    common = argv[:i] + rest
    return [common + t for t in turns]


def exception_chain(e):
    """The classes of exception `e` up to (not including) Exception, e.g.
    ["BadRequestError", "APIStatusError", "APIError", "OpenAIError"]."""
    chain = []
    for cls in type(e).__mro__:
        if cls is Exception:
            break
        chain.append(cls.__name__)
    return chain


def dump(obj):
    """A model of the SDK as the JSON the API sent (its to_dict); None stays None."""
    if obj is None:
        return None
    if hasattr(obj, "to_dict"):
        return obj.to_dict(mode="json")
    return obj


def extra(obj, name):
    """An extra (undeclared) member the SDK's models keep: pydantic's model_extra."""
    extras = getattr(obj, "model_extra", None) or {}
    return extras.get(name)


def json_or_text(raw):
    """Bytes as the JSON they hold, else as text."""
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text
