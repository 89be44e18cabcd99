"""JSON over HTTP to SGLang / OpenAI-compatible servers (stdlib only): bounded retries with backoff,
then one clear error. Used by the trainer's regeneration and the evaluations."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class ServerRefused(ValueError):
    """The server answered 4xx: the request is wrong (too long for the context, a bad field), and asking again
    would not help; its message is kept."""


def post_json(url: str, payload: dict, retries: int = 3, timeout: float = 600) -> dict:
    last = None
    body = json.dumps(payload).encode()
    for attempt in range(retries + 1):
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # before URLError, its base class: the server is there and answered
            detail = e.read().decode(errors="replace")[:500] if e.fp is not None else ""
            if 400 <= e.code < 500:
                raise ServerRefused(f"{url} refused the request: HTTP {e.code} {e.reason}: {detail}") from None
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


def get_json(url: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())
