"""JSON over HTTP to SGLang / OpenAI-compatible servers (stdlib only): bounded retries with backoff,
then one clear error. Used by the trainer's regeneration and the evaluations."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

API_KEY_ENV = "OPENAI_API_KEY"  # what OpenAI clients read; SGLang's --api-key server checks it as a bearer token


def add_api_key_argument(parser) -> None:
    """`--api-key`, the same for every tool that talks to a server."""
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, metavar="KEY",
                        help=f"the key of servers started with --api-key, sent as a bearer token (default: "
                             f"${API_KEY_ENV})")


def redacted(options: dict) -> dict:
    """A tool's options for its report: the API key's value is not written to disk."""
    return {k: ("<given>" if k == "api_key" and v else v) for k, v in options.items()}


def headers(api_key: str | None) -> dict:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def _refusal(url: str, e: urllib.error.HTTPError, detail: str, api_key: str | None) -> ServerRefused:
    hint = ""
    if e.code in (401, 403):
        hint = (" -- the server wants an API key: pass --api-key or set " + API_KEY_ENV if not api_key else
                " -- the server did not accept the API key given (--api-key / " + API_KEY_ENV + ")")
    return ServerRefused(f"{url} refused the request: HTTP {e.code} {e.reason}: {detail}{hint}")


class ServerRefused(ValueError):
    """The server answered 4xx: the request is wrong (too long for the context, a bad field), and asking again
    would not help; its message is kept."""


def post_json(url: str, payload: dict, retries: int = 3, timeout: float = 600, api_key: str | None = None) -> dict:
    last = None
    body = json.dumps(payload).encode()
    for attempt in range(retries + 1):
        try:
            req = urllib.request.Request(url, data=body, headers=headers(api_key))
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # before URLError, its base class: the server is there and answered
            detail = e.read().decode(errors="replace")[:500] if e.fp is not None else ""
            if 400 <= e.code < 500:
                raise _refusal(url, e, detail, api_key) from None
            last = f"HTTP {e.code} {e.reason}: {detail}"
            if attempt < retries:
                time.sleep(min(2 ** attempt, 8))
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as e:
            last = e
            if attempt < retries:
                time.sleep(min(2 ** attempt, 8))
    if isinstance(last, str):  # 5xx every time
        raise ConnectionError(f"{url} failed {retries + 1} times: {last}")
    raise ConnectionError(f"cannot reach {url} after {retries + 1} attempts ({last}); "
                          "is the server running and the URL right?")


def get_json(url: str, timeout: float = 30, api_key: str | None = None) -> dict:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers(api_key)), timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if 400 <= e.code < 500:
            detail = e.read().decode(errors="replace")[:500] if e.fp is not None else ""
            raise _refusal(url, e, detail, api_key) from None
        raise
