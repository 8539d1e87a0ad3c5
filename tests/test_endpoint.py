"""keel.endpoint against a loopback server that speaks the OpenAI chat-completions protocol."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from keel.endpoint import EndpointError, chat, completions_url, endpoint_policy, hermes_messages
from keel.episode import run_text_episode
from keel.kg.env import KGEnv
from keel.kg.store import MemoryStore
from keel.types import Task


class LoopbackServer:
    """A chat-completions server on 127.0.0.1 (a free port) in a thread.

    `replies` is consumed in order; each is a string (the assistant content, status 200) or a
    (status, raw body) pair. Every request is recorded as {"path", "headers", "body"}.
    """

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(raw)})
                reply = owner.replies.pop(0) if owner.replies else (500, "no scripted reply left")
                if isinstance(reply, str):
                    status, body = 200, json.dumps({"id": "x", "object": "chat.completion", "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]})
                else:
                    status, body = reply
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_chat_posts_openai_request_and_returns_content(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with LoopbackServer(["Paris", "Lyon"]) as server:
        out = chat(server.base_url, "gpt-test", [{"role": "user", "content": "capital?"}], api_key="sk-1", temperature=0.5, max_tokens=7)
        assert out == "Paris"
        req = server.requests[0]
        assert req["path"] == "/v1/chat/completions"
        assert req["headers"]["Authorization"] == "Bearer sk-1"
        assert req["body"] == {"model": "gpt-test", "messages": [{"role": "user", "content": "capital?"}], "temperature": 0.5, "max_tokens": 7}
        # no key anywhere: no Authorization header at all (local servers)
        assert chat(server.base_url + "/", "m", [{"role": "user", "content": "x"}]) == "Lyon"
        assert "Authorization" not in server.requests[1]["headers"]


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    with LoopbackServer(["ok"]) as server:
        assert chat(server.base_url, "m", [{"role": "user", "content": "x"}]) == "ok"
        assert server.requests[0]["headers"]["Authorization"] == "Bearer sk-env"


def test_errors_are_one_line_and_name_url_and_status():
    with LoopbackServer([(429, '{"error": {"message": "rate limited\\nslow down"}}'), (200, "not json"), (200, '{"choices": []}')]) as server:
        url = server.base_url + "/chat/completions"
        with pytest.raises(EndpointError) as e:
            chat(server.base_url, "m", [{"role": "user", "content": "x"}])
        msg = str(e.value)
        assert msg.startswith(url + ": HTTP 429") and "rate limited slow down" in msg and "\n" not in msg
        with pytest.raises(EndpointError, match="response is not a chat completion: not json"):
            chat(server.base_url, "m", [{"role": "user", "content": "x"}])
        with pytest.raises(EndpointError, match="not a chat completion"):
            chat(server.base_url, "m", [{"role": "user", "content": "x"}])


def test_connection_refused_and_bad_urls():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(EndpointError, match=rf"http://127.0.0.1:{port}/v1/chat/completions: cannot connect"):
        chat(f"http://127.0.0.1:{port}/v1", "m", [{"role": "user", "content": "x"}], timeout=5)
    with pytest.raises(EndpointError, match="not an http"):
        completions_url("ftp://example.org/v1")
    with pytest.raises(EndpointError, match="base_url is empty"):
        endpoint_policy("", "m")
    with pytest.raises(EndpointError, match="messages must be a list"):
        chat("http://127.0.0.1:1/v1", "m", [{"role": "user", "content": None}])


def test_hermes_messages_merge_tool_results_into_one_user_turn():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<tool_call>..</tool_call>"},
        {"role": "tool", "content": "[1]"},
        {"role": "tool", "content": "[2]"},
        {"role": "assistant", "content": "done"},
    ]
    out = hermes_messages(msgs, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[0]["content"].startswith("S\n\n# Tools") and '{"type": "function", "function": {"name": "f", "parameters": {}}}' in out[0]["content"]
    assert out[3]["content"] == "<tool_response>\n[1]\n</tool_response>\n<tool_response>\n[2]\n</tool_response>"
    assert hermes_messages(msgs)[0]["content"] == "S"  # no tools: instructions only
    with pytest.raises(ValueError, match="unknown role 'function'"):
        hermes_messages([{"role": "function", "content": "x"}])


def test_endpoint_policy_drives_a_kg_episode():
    store = MemoryStore.from_triples([("m.film", "film.directed_by", "m.bob")], {"m.film": "Heat", "m.bob": "Bob"})
    env = KGEnv(store)
    task = Task(id="t", question="Who directed Heat?", answers=["Bob"], topic_entities={"m.film": "Heat"})
    call = '<tool_call>\n{"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": "film.directed_by"}}\n</tool_call>'
    with LoopbackServer([call, "<answer>Bob</answer>"]) as server:
        ep = run_text_episode(env, task, endpoint_policy(server.base_url, "m", env=env), max_turns=4)
        assert ep.answer == "Bob" and ep.finished and [s.observation.text for s in ep.steps] == ['["Bob (m.bob)"]']
        second = server.requests[1]["body"]["messages"]
        assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
        assert "<tools>" in second[0]["content"] and "get_tail_entities" in second[0]["content"]
        assert second[3]["content"] == '<tool_response>\n["Bob (m.bob)"]\n</tool_response>'
