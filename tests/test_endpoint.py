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


def test_timeout_is_a_total_deadline_not_a_per_read_one():
    """A server that sends its body one byte every 0.2 s never lets a per-read timeout fire;
    the deadline covers the whole request."""
    import time

    class Drip(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        t0 = time.monotonic()
        with pytest.raises(EndpointError, match=r"/chat/completions: no complete response within 1 s"):
            chat(url, "m", [{"role": "user", "content": "x"}], timeout=1)
        assert time.monotonic() - t0 < 2.5
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_failed_requests_are_retried_with_back_off_and_client_errors_are_not():
    with LoopbackServer([(503, "busy"), (500, "oops"), "ok", (400, '{"error": "bad model"}')]) as server:
        assert chat(server.base_url, "m", [{"role": "user", "content": "x"}], retries=2, backoff=0.01) == "ok"
        assert len(server.requests) == 3
        with pytest.raises(EndpointError, match="HTTP 400.*bad model"):
            chat(server.base_url, "m", [{"role": "user", "content": "x"}], retries=2, backoff=0.01)
        assert len(server.requests) == 4  # a 400 is not tried again
    with LoopbackServer([(500, "a"), (500, "b")]) as server:
        with pytest.raises(EndpointError, match=r"HTTP 500.*\(after 2 attempts\)"):
            chat(server.base_url, "m", [{"role": "user", "content": "x"}], retries=1, backoff=0.01)


ONE_RETRY = ["--endpoint-model", "m", "--retries", "1", "--backoff", "0.01", "--timeout", "5"]


def _assert_q1_failed(out) -> None:
    """Of three questions, q1's request failed twice (HTTP 500, then 502): recorded as its error,
    scored 0, counted in the summary; q0 and q2 answered right."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 3 and summary["request_errors"] == 1 and summary["eval/em"] == pytest.approx(2 / 3)
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["em"] for r in results] == [1.0, 0.0, 1.0] and "HTTP 502" in results[1]["error"] and "error" not in results[0]


def test_eval_keeps_what_it_has_when_one_question_fails(tmp_path, capsys):
    """q0 answered; q1's request fails on both attempts (recorded as its error, scored 0); q2
    answered; the summary counts the error."""
    from keel.cli import main

    (tmp_path / "kb.tsv").write_text("m.film\tfilm.film.directed_by\tm.bob\n")
    rows = [Task(id=f"q{i}", question=f"Who directed m.film ({i})?", answers=["m.bob"]).to_dict() for i in range(3)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ev"
    with LoopbackServer(["<answer>m.bob</answer>", (500, "down"), (502, "still down"), "<answer>m.bob</answer>"]) as server:
        rc = main(["eval", "--env", "kg", "--data", str(tmp_path / "q.jsonl"), "--kb", str(tmp_path / "kb.tsv"), "--policy", "endpoint",
                   "--base-url", server.base_url, *ONE_RETRY, "--out", str(out)])
    assert rc == 0
    _assert_q1_failed(out)
    assert "question q1:" in capsys.readouterr().err


def test_config_eval_keeps_what_it_has_when_one_question_fails(tmp_path, capsys, monkeypatch):
    """`eval --config PRESET --policy endpoint` as the KG path above: the example's dev questions
    q0 (answer 8) and q2 (answer 5) answered, q1's request failing twice recorded as its error."""
    from pathlib import Path

    from keel.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the preset's paths are relative to the repository
    out = tmp_path / "ev"
    with LoopbackServer(["<answer>8</answer>", (500, "down"), (502, "still down"), "<answer>5</answer>"]) as server:
        rc = main(["eval", "--config", "examples/sql_tools/preset.yaml", "--limit", "3", "--policy", "endpoint",
                   "--base-url", server.base_url, *ONE_RETRY, "--out", str(out)])
    assert rc == 0
    _assert_q1_failed(out)
    assert "question " in capsys.readouterr().err


def test_eval_help_has_timeout_and_retries(capsys):
    from keel.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert "--timeout" in text and "--retries" in text
