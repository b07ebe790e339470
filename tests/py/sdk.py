"""The SDK a test client drives, imported with a clear message when it is missing.

The clients run with the venv python that `cargo xtask setup` makes, where the pinned SDKs
are installed; any other python most likely lacks them, and says so here rather than with a
traceback.
"""

import importlib
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


def client(sdk, cls, args):
    """A client of `sdk`'s class `cls` for one test run's `args` (base_url, api_key, timeout):
    one request per turn, since the tests count turns and streams (max_retries=0), and no
    proxies from the environment."""
    return cls(
        base_url=args.base_url,
        api_key=args.api_key,
        timeout=args.timeout,
        max_retries=0,
        http_client=sdk.DefaultHttpxClient(trust_env=False),
    )
