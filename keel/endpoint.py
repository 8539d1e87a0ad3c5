"""A client for any OpenAI-compatible chat-completions endpoint, and a text policy built on it.

Paper A uses an LLM as the reflection analyzer (PRS), and paper B evaluates GPT-4o on the same
KG interface as a control. Both need one thing: send chat messages to an endpoint, get text.
Keel speaks the plain HTTP protocol with the standard library (`POST {base}/chat/completions`,
JSON body, `Authorization: Bearer <key>`), so vLLM, llama.cpp's server, Ollama or a hosted API
all work, and no client package is needed.

Where Keel departs from a native tool-calling client: tools are *not* sent in the `tools`
field. The system message carries them in Keel's Hermes layout (`<tools>` listing, calls as
`<tool_call>` JSON) and tool results go back as user messages wrapped in `<tool_response>`,
exactly the text a small model sees in `keel.rollout`, so a large model is measured on the same
interface, not on its provider's tool-calling layer.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable

from keel.chat import TOOLS_POSTAMBLE, TOOLS_PREAMBLE
from keel.errors import UserError
from keel.types import Env, Task

API_KEY_ENV = "OPENAI_API_KEY"
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
_BODY_CHARS = 200  # characters of an error response quoted in an EndpointError


class EndpointError(UserError, RuntimeError):
    """A failed chat-completions request. The message is one line naming the URL and the cause."""


def _one_line(text: str, limit: int = _BODY_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def completions_url(base_url: str) -> str:
    """`{base}/chat/completions`; `base_url` is what OpenAI clients call the base URL
    (e.g. http://127.0.0.1:8000/v1). Raises EndpointError for anything but http(s)."""
    if not isinstance(base_url, str) or not base_url.strip():
        raise EndpointError(f"endpoint base_url is empty (got {base_url!r}); expected e.g. http://127.0.0.1:8000/v1")
    parsed = urllib.parse.urlparse(base_url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EndpointError(f"endpoint base_url {_one_line(base_url, 80)!r} is not an http(s) URL")
    return base_url.strip().rstrip("/") + "/chat/completions"


def _opener(url: str):
    # A loopback server must not be sent through an HTTP proxy configured for the outside world.
    host = urllib.parse.urlparse(url).hostname or ""
    if host in _LOOPBACK:
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


RETRY_STATUSES = {408, 409, 425, 429, 500, 502, 503, 504}  # worth another try; other 4xx will not change


class _Retryable(EndpointError):
    """A failure that another attempt may not have (connection, timeout, 5xx, a torn body)."""


def _post(url: str, request, timeout: float) -> bytes:
    """The body of one POST, within `timeout` seconds in all: connecting, the headers and the
    whole body (urllib's own timeout bounds each socket read, so a server that sends one byte
    every few seconds would never time out). The request runs in a daemon thread; past the
    deadline its socket is shut down, which ends the thread."""
    import threading

    box: dict[str, Any] = {}

    def work():
        try:
            with _opener(url).open(request, timeout=timeout) as response:
                box["response"] = response
                box["raw"] = response.read()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=work, name="keel-endpoint", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        sock = getattr(getattr(getattr(box.get("response"), "fp", None), "raw", None), "_sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        raise _Retryable(f"{url}: no complete response within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["raw"]


def _attempt(url: str, request, timeout: float) -> str:
    try:
        raw = _post(url, request, timeout)
    except EndpointError:
        raise
    except urllib.error.HTTPError as exc:
        detail = ""
        try:
            detail = exc.read().decode("utf-8", "replace")
            err = json.loads(detail).get("error")  # OpenAI's shape: {"error": {"message": ...}}
            detail = err.get("message", detail) if isinstance(err, dict) else (err if isinstance(err, str) else detail)
        except Exception:
            pass
        kind = _Retryable if exc.code in RETRY_STATUSES else EndpointError
        raise kind(f"{url}: HTTP {exc.code} {exc.reason}" + (f": {_one_line(detail)}" if detail else "")) from None
    except (socket.timeout, TimeoutError):
        raise _Retryable(f"{url}: no response within {timeout:g} s") from None
    except urllib.error.URLError as exc:
        raise _Retryable(f"{url}: cannot connect ({_one_line(exc.reason, 80)})") from None
    except OSError as exc:
        raise _Retryable(f"{url}: connection failed ({type(exc).__name__}: {_one_line(exc, 80)})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
        content = data["choices"][0]["message"]["content"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, IndexError, TypeError):
        raise _Retryable(f"{url}: response is not a chat completion: {_one_line(raw.decode('utf-8', 'replace'))}") from None
    if content is None:  # a model that answered only through the native `tool_calls` field
        content = ""
    if not isinstance(content, str):
        raise EndpointError(f"{url}: choices[0].message.content is {type(content).__name__}, not text")
    return content


def chat(
    base_url: str,
    model: str,
    messages: list[dict[str, str]],
    api_key: str | None = None,
    timeout: float = 60,
    temperature: float = 0.0,
    max_tokens: int = 512,
    retries: int = 0,
    backoff: float = 1.0,
) -> str:
    """The assistant text of one chat completion.

    The key is `api_key`, else the environment variable OPENAI_API_KEY, else none (local
    servers). `timeout` is the total deadline of one attempt (connect, headers, body). A
    failure another attempt may not have (connection, timeout, HTTP 408/429/5xx, a body that is
    not a chat completion) is tried again up to `retries` times, after backoff·1, 2, 4... s.
    What still fails raises EndpointError with a one-line message naming the URL (and, after
    retries, how many attempts were made).
    """
    import time

    url = completions_url(base_url)
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise EndpointError(f"{url}: messages must be a list of {{'role', 'content': str}} dicts")
    if not timeout > 0:
        raise EndpointError(f"{url}: timeout must be > 0 s, got {timeout!r}")
    key = api_key if api_key else os.environ.get(API_KEY_ENV) or None
    body = json.dumps(
        {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}, ensure_ascii=False
    ).encode("utf-8")
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            return _attempt(url, request, timeout)
        except _Retryable as exc:
            if attempt == retries:
                raise EndpointError(str(exc) + (f" (after {retries + 1} attempts)" if retries else "")) from None
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


def system_content(instructions: str, tools: list[dict[str, Any]]) -> str:
    """The system message a Keel model sees: the instructions, then the Hermes tools listing
    (the same text `keel.rollout.encode_prompt` encodes, without the ChatML markers)."""
    if not tools:
        return instructions
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return instructions + "\n\n" + TOOLS_PREAMBLE + schemas + TOOLS_POSTAMBLE


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
    """Keel messages (roles system/user/assistant/tool) → chat-completions messages.

    Consecutive tool results become one user message of `<tool_response>` blocks, as
    `keel.chat.render_tool_responses` renders them; `tools`, when given, are listed in the
    system message. Worked example:
        [system "S", user "Q", assistant "<tool_call>..", tool "[1]", tool "[2]"] →
        [system "S\\n\\n# Tools..", user "Q", assistant "<tool_call>..",
         user "<tool_response>\\n[1]\\n</tool_response>\\n<tool_response>\\n[2]\\n</tool_response>"]
    """
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message {len(out)}: content must be a string, got {type(content).__name__}")
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": "1"})
            continue
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"message {len(out)}: unknown role {role!r} (expected system, user, assistant or tool)")
        if role == "system" and tools:
            content = system_content(content, tools)
        out.append({"role": role, "content": content})
    if tools and not any(m["role"] == "system" for m in out):
        out.insert(0, {"role": "system", "content": system_content("", tools).lstrip("\n")})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def endpoint_policy(
    base_url: str,
    model: str,
    api_key: str | None = None,
    env: Env | None = None,
    temperature: float = 0.0,
    max_tokens: int = 512,
    timeout: float = 60,
    retries: int = 0,
    backoff: float = 1.0,
) -> Callable[[Task, list[dict[str, Any]]], str]:
    """A text policy `fn(task, messages) -> str` for `keel.episode.run_text_episode`.

    `env`, when given, supplies the task's tool schemas for the system message (run_text_episode's
    messages carry only the instructions). Endpoint failures raise EndpointError.
    """
    completions_url(base_url)  # a bad URL fails here, not at the first episode

    def policy(task: Task, messages: list[dict[str, Any]]) -> str:
        tools = env.tools(task) if env is not None else None
        return chat(base_url, model, hermes_messages(messages, tools), api_key=api_key, timeout=timeout,
                    temperature=temperature, max_tokens=max_tokens, retries=retries, backoff=backoff)

    return policy


def request_errors(rows: list[dict[str, Any]]) -> int:
    """How many questions of an evaluation lost their endpoint request (recorded as the row's
    `error` and scored 0) — the `request_errors` of an eval summary."""
    return sum(1 for r in rows if "error" in r)
