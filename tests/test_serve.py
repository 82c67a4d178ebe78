"""`gumiho serve`: OpenAI's chat and completions endpoints over a speculative generator,
answering as `generate` answers, streamed or whole, and refusing bad requests with a 400
that says why."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import REFERENCE_PROMPT as PROMPT
from conftest import REFERENCE_TOKENS as N


def post(url, body, raw=False):
    """(status, parsed JSON or the raw text) of a POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            text = response.read().decode()
            return response.status, text if raw else json.loads(text)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def events(text):
    """The JSON payloads of a server-sent event stream, and whether it ended in [DONE]."""
    data = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"], data[-1] == "[DONE]"


def test_a_chat_completion_is_generates_answer(served, reference):
    """Greedy, whole and streamed: the text and token count `generate` gives, OpenAI's
    shape (choices, finish_reason, usage), and the speculative statistics."""
    url, gen = served
    ids, want = reference[0], reference[1]
    body = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": N, "temperature": 0}
    status, out = post(url + "/v1/chat/completions", body)
    assert status == 200 and out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": N,
                            "total_tokens": len(ids) + N}
    assert out["speculative"]["method"] == "gumiho" and out["speculative"]["tau"] > 1.1
    status, text = post(url + "/v1/chat/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": True}},
                        raw=True)
    chunks, done = events(text)
    assert status == 200 and done
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                   if c["choices"]) == want.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == N


def test_completions_logprobs_stop_and_sampling_settings(served, smollm2):
    """A raw prompt (no chat template), a stop string (finish_reason "stop", the text
    before it), logprobs with alternatives, and vLLM's extras reach `generate`."""
    url, gen = served
    prompt = "The three primary colours are"
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 2,
            "stop": [","], "repetition_penalty": 1.1, "top_k": 5}
    status, out = post(url + "/v1/completions", body)
    assert status == 200, out
    ids = smollm2.tokenizer(prompt).input_ids
    want = gen.generate(ids, 16, stop=[","], repetition_penalty=1.1, top_k=5,
                        top_logprobs=2)
    choice = out["choices"][0]
    assert choice["text"] == want.text and "," not in choice["text"]
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"]["token_logprobs"] == want.logprobs
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
    status, out = post(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3})
    content = out["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == 4 and len(content[0]["top_logprobs"]) == 3
    assert content[0]["logprob"] == content[0]["top_logprobs"][0]["logprob"]


def test_a_stream_with_logprobs_carries_each_cycles(served):
    """Streamed with logprobs, chat and completions: a chunk a cycle, and what the chunks
    carry joins to the whole response's text and logprobs (tokens, offsets, alternatives)."""
    url, _ = served
    messages = [{"role": "user", "content": PROMPT}]
    for path, body, key in (
            ("/v1/chat/completions", {"messages": messages, "logprobs": True,
                                      "top_logprobs": 2}, "content"),
            ("/v1/completions", {"prompt": PROMPT, "logprobs": 2}, None)):
        body = {**body, "max_tokens": N, "temperature": 0}
        whole = post(url + path, body)[1]["choices"][0]
        status, text = post(url + path, {**body, "stream": True}, raw=True)
        chunks, done = events(text)
        assert status == 200 and done
        parts = [c["choices"][0] for c in chunks if c["choices"]]
        scored = [p["logprobs"] for p in parts if p.get("logprobs")]
        assert len(scored) > 1
        if key:  # chat
            assert "".join(p["delta"].get("content", "") for p in parts) == \
                whole["message"]["content"]
            assert sum((s["content"] for s in scored), []) == whole["logprobs"]["content"]
        else:
            assert "".join(p["text"] for p in parts) == whole["text"]
            for field in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
                assert sum((s[field] for s in scored), []) == whole["logprobs"][field], field


def test_n_answers_are_sampled_with_seed_seed_plus_one_and_so_on(served, monkeypatch):
    """n = 3 at T = 0.9 with seed 7: answers i are `generate`'s with seed 7 + i; a request
    without a seed gets a fresh random one (here 40, made to be)."""
    import gumiho.serve

    url, gen = served
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
            "temperature": 0.9}
    status, out = post(url + "/v1/chat/completions", {**body, "n": 3, "seed": 7})
    texts = [c["message"]["content"] for c in out["choices"]]
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert texts == [gen.generate(PROMPT, 12, temperature=0.9, seed=7 + i).text
                     for i in range(3)]
    assert len(set(texts)) > 1
    assert out["usage"]["completion_tokens"] == 36
    status, text = post(url + "/v1/chat/completions",  # streamed: answer by answer
                        {**body, "n": 3, "seed": 7, "stream": True,
                         "stream_options": {"include_usage": True}}, raw=True)
    chunks, done = events(text)
    assert status == 200 and done
    for i in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"]
                and c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == texts[i]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"]
    indexes = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert indexes == sorted(indexes) and chunks[-1]["usage"]["completion_tokens"] == 36
    monkeypatch.setattr(gumiho.serve.secrets, "randbelow", lambda n: 40)
    out = post(url + "/v1/chat/completions", body)[1]
    assert out["choices"][0]["message"]["content"] == gen.generate(
        PROMPT, 12, temperature=0.9, seed=40).text


@pytest.mark.parametrize("path, body, status, says", [
    ("/v1/chat/completions", b"{not json", 400, "invalid JSON"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user",
                                                              "content": "hi"}]},
     404, "not served"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0},
     400, "n must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17,
                              "stream": True}, 400, "n must be an integer"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stream": True, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stream": True, "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "context"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt"),
    ("/v1/embeddings", {"input": "hi"}, 404, "no such path"),
    pytest.param("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400,
                 "nests too deeply", id="deep-json"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stream": True, "stream_options": "x"}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stream_options": {"include_usage": True}}, 400, "stream: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": "7"},
     400, "seed must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, 400,
     "response_format"),
])
def test_bad_requests_are_refused_with_a_reason(served, path, body, status, says):
    url, _ = served
    got, out = post(url + path, body)
    assert got == status and says in out["error"]["message"], out


def test_a_body_past_the_limit_is_refused_unread(served):
    import http.client

    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(10**9))  # announced, never sent
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and b"at most" in response.read()
    conn.close()


def test_what_openai_clients_send_by_default_is_taken(served):
    """Fields a client library sends unset or at their defaults: max_completion_tokens
    null (max_tokens holds), response_format text, a query string on the path; a stream
    with include_usage has `usage: null` on every chunk before the last, and each choice
    `logprobs: null` where none were asked for."""
    url, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "max_completion_tokens": None, "temperature": 0,
            "response_format": {"type": "text"}}
    status, out = post(url + "/v1/chat/completions?api-version=1", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    with urllib.request.urlopen(url + "/v1/models?limit=1") as response:
        assert response.status == 200
    status, text = post(url + "/v1/completions", {
        "prompt": "One, two,", "max_tokens": 3, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}, raw=True)
    chunks, done = events(text)
    assert status == 200 and done
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]
    assert all(c["choices"][0]["logprobs"] is None for c in chunks[:-1])


def raw_request(url, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send a hand-written request over a socket: (status, parsed JSON body)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_a_body_is_read_before_any_refusal(served):
    """A refused request's body is read first, so a client still sending it hears the
    refusal, not a broken pipe; a body without a usable Content-Length is refused with a
    reason."""
    url, _ = served
    big = json.dumps({"input": "x" * 4_000_000}).encode()
    status, out = raw_request(url, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Length: %d" % len(big), big)
    assert status == 404 and "no such path" in out["error"]["message"]
    status, out = raw_request(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Length: -1")
    assert status == 400 and "Content-Length" in out["error"]["message"]
    status, out = raw_request(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Transfer-Encoding: chunked", b"0\r\n\r\n")
    assert status == 411 and "Content-Length" in out["error"]["message"]


def test_a_client_leaving_before_a_whole_answer_is_no_refusal(served, caplog):
    """A non-streamed request whose client hangs up while it generates: one log line,
    no 500 counted, and the next request is answered."""
    import logging
    import socket

    caplog.set_level(logging.INFO, logger="gumiho")
    url, _ = served
    _, before = scrape(url)
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
                       "temperature": 0, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.3)  # then gone (a reset) while it generates
    status, out = post(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})
    assert status == 200
    assert "client left before its answer was sent" in caplog.text
    assert "request failed" not in caplog.text
    _, after = scrape(url)
    refused = {k: v for k, v in after.items() if "refused" in k}
    assert refused == {k: v for k, v in before.items() if "refused" in k}


def test_a_bug_while_generating_is_a_500_not_the_clients_fault(served, monkeypatch, caplog):
    """A request is checked before it generates, so a ValueError from inside a generation
    is the server's (a 500, its traceback logged), not a 400 blaming the request."""
    url, gen = served

    def broken(*args, **kwargs):
        raise ValueError("a bug deep inside")

    monkeypatch.setattr(gen, "generate", broken)
    status, out = post(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 500 and out["error"]["message"] == "ValueError: a bug deep inside"
    assert "request failed" in caplog.text
    status, out = post(url + "/v1/completions", {"prompt": [1, "x"], "max_tokens": 2})
    assert status == 400 and "token ids" in out["error"]["message"], out


def test_metric_values_are_written_exactly():
    from gumiho.metrics import Metrics

    metrics = Metrics()
    metrics.generation_tokens, metrics.latency_s = 1_234_567, 123_456.789
    _, values = scrape_text(metrics.text(0, 0))
    assert values["gumiho:generation_tokens_total"] == 1_234_567
    assert values["gumiho:e2e_request_latency_seconds_sum"] == 123_456.789


def test_models_and_health(served):
    url, _ = served
    with urllib.request.urlopen(url + "/v1/models") as response:
        assert json.loads(response.read())["data"][0]["id"] == "smollm2"
    with urllib.request.urlopen(url + "/health") as response:
        assert response.status == 200


def test_tokenize_and_detokenize(served, smollm2):
    """vLLM's endpoints: a chat's ids are the ones a chat completion counts as its prompt,
    a text's the tokenizer's; detokenize gives the text back; ids outside the vocabulary
    are a 400."""
    url, gen = served
    messages = [{"role": "user", "content": PROMPT}]
    status, out = post(url + "/tokenize", {"messages": messages})
    assert status == 200 and out["tokens"] == smollm2.chat_ids(messages)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 8192
    usage = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 1})[1]
    assert usage["usage"]["prompt_tokens"] == out["count"]
    status, out = post(url + "/tokenize", {"prompt": "Hello there"})
    assert out["tokens"] == smollm2.tokenizer("Hello there").input_ids
    assert post(url + "/detokenize", {"tokens": out["tokens"]})[1] == {"prompt": "Hello there"}
    for bad in ([49152], ["a"], "12"):
        status, out = post(url + "/detokenize", {"tokens": bad})
        assert status == 400 and "token id" in out["error"]["message"], out
    assert post(url + "/tokenize", {"prompt": "hi", "model": "other"})[0] == 404


def scrape(url):
    """GET /metrics: its text and {name with labels: value}."""
    with urllib.request.urlopen(url + "/metrics") as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return scrape_text(response.read().decode())


def scrape_text(text):
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return text, values


def test_metrics_count_what_the_answers_did(served):
    """vLLM's metric names under gumiho:, each moved by what a request did: its tokens, its
    finish reason, its cycles and the draft tokens accepted at each position; a refused
    request by its status."""
    url, gen = served
    _, before = scrape(url)
    status, out = post(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": N, "temperature": 0})
    assert status == 200
    verify = gen.last_result.accept_lengths[1:]  # the verify cycles' tokens
    assert post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 10**6})[0] == 400
    text, after = scrape(url)

    def moved(name):
        return after.get("gumiho:" + name, 0) - before.get("gumiho:" + name, 0)

    assert moved("generation_tokens_total") == out["usage"]["completion_tokens"] == N
    assert moved("prompt_tokens_total") == out["usage"]["prompt_tokens"]
    assert moved('request_success_total{finished_reason="length"}') == 1
    assert moved('request_refused_total{status="400"}') == 1
    assert moved("e2e_request_latency_seconds_count") == 1
    assert moved("e2e_request_latency_seconds_sum") > 0
    assert moved("spec_decode_num_drafts_total") == len(verify) == \
        out["speculative"]["cycles"] - 1
    assert moved("spec_decode_num_accepted_tokens_total") == sum(verify) - len(verify) > 0
    for k in range(max(verify) - 1):
        assert moved(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{k}"}}') \
            == sum(a - 1 > k for a in verify)
    assert after["gumiho:num_requests_running"] == after["gumiho:num_requests_waiting"] == 0
    for name in {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}:
        assert f"# HELP {name} " in text


def test_a_server_that_reuses_prefixes_says_so(served):
    """With --reuse-prefix, a conversation's next turn reports the history's tokens as
    OpenAI's `cached_tokens`, and the metrics count them as prefix-cache hits."""
    from gumiho.serve import make_server
    from gumiho.worker import Worker

    _, gen = served
    worker = Worker()
    server = make_server(gen, "smollm2", "gumiho", worker, reuse_prefix=True)
    for loop in (server.serve_forever, worker.run_forever):
        threading.Thread(target=loop, daemon=True).start()
    url = "http://{}:{}".format(*server.server_address[:2])
    try:
        messages = [{"role": "user", "content": PROMPT}]
        body = {"messages": messages, "max_tokens": 12, "temperature": 0}
        post(url + "/v1/chat/completions", body)
        _, before = scrape(url)
        again = post(url + "/v1/chat/completions", body)[1]  # the same prompt: all but
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            again["usage"]["prompt_tokens"] - 1  # its last token, which the answer needs
        messages += [again["choices"][0]["message"],
                     {"role": "user", "content": "And two more?"}]
        status, out = post(url + "/v1/chat/completions", {**body, "messages": messages})
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert status == 200 and cached == gen.last_result.reused_tokens
        assert cached > again["usage"]["prompt_tokens"]  # the history and part of its answer
        _, after = scrape(url)
        assert after["gumiho:prefix_cache_hits_total"] - \
            before["gumiho:prefix_cache_hits_total"] == \
            cached + again["usage"]["prompt_tokens"] - 1
    finally:
        server.shutdown()
        server.server_close()
        worker.stop()


def test_an_api_key_guards_the_api_and_not_health(served):
    """--api-key: /v1 and /tokenize want `Authorization: Bearer KEY` (a 401 without it or
    with another), /health, /version and /metrics answer anyone."""
    from gumiho.serve import make_server
    from gumiho.version import __version__
    from gumiho.worker import Worker

    _, gen = served
    worker = Worker()
    server = make_server(gen, "smollm2", "gumiho", worker, api_key="sesame")
    for loop in (server.serve_forever, worker.run_forever):
        threading.Thread(target=loop, daemon=True).start()
    url = "http://{}:{}".format(*server.server_address[:2])

    def status(path, key=None, body=None):
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, data, headers),
                                        timeout=300) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert status("/v1/models")[0] == status("/v1/models", "wrong")[0] == 401
        code, out = status("/v1/chat/completions", body=chat)
        assert code == 401 and "Authorization: Bearer" in out["error"]["message"]
        assert status("/tokenize", body={"prompt": "hi"})[0] == 401
        assert status("/v1/models", "sesame")[0] == 200
        assert status("/v1/chat/completions", "sesame", chat)[0] == 200
        assert status("/health")[0] == 200
        code, out = status("/version")
        assert code == 200 and out["version"] == __version__
    finally:
        server.shutdown()
        server.server_close()
        worker.stop()


def test_a_client_leaving_mid_stream_frees_the_generator(served, caplog):
    """A stream whose client hangs up stops (long before its 400 tokens); the next
    request is answered."""
    import http.client
    import logging

    caplog.set_level(logging.INFO, logger="gumiho")
    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 400,
        "temperature": 0, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    _, before = scrape(url)
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    response.close()
    conn.close()  # gone after the first chunk
    status, out = post(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    assert "client left mid-stream" in caplog.text
    _, after = scrape(url)  # the stream left counts as an abort, the next as a length
    for reason, more in (("abort", 1), ("length", 1), ("stop", 0)):
        name = f'gumiho:request_success_total{{finished_reason="{reason}"}}'
        assert after[name] - before[name] == more, reason


def test_a_stream_that_fails_midway_ends_with_an_error_event(served, monkeypatch):
    """A generation that fails after the first chunk (the 200 is sent by then): an `error`
    event, then [DONE], not a second status line inside the stream."""
    from gumiho.errors import GumihoError

    url, gen = served

    def failing(ids, **settings):
        gen.last_result = None  # as a stream that fails leaves it

        def pieces():
            yield "Hello"
            raise GumihoError("the KV cache is full")
        return pieces()

    monkeypatch.setattr(gen, "stream", failing)
    status, text = post(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True}, raw=True)
    chunks, done = events(text)
    assert status == 200 and done and "HTTP/1" not in text
    assert chunks[1]["choices"][0]["delta"]["content"] == "Hello"
    assert chunks[-1] == {"error": {"message": "the KV cache is full",
                                    "type": "invalid_request_error"}}


def test_ctrl_c_during_a_generation_stops_the_worker():
    """Ctrl-C on the worker's thread (the server's main thread) while it runs a request:
    the worker stops with it, as `gumiho serve` then stops, and the request's thread hears
    that the server stopped instead of a KeyboardInterrupt of its own; the same for a
    stream."""
    from gumiho.worker import Stopped, Worker

    def interrupted():
        raise KeyboardInterrupt

    def interrupted_stream():
        yield 1
        raise KeyboardInterrupt

    for ask in (lambda w: w.call(interrupted), lambda w: list(w.iterate(interrupted_stream))):
        worker, heard = Worker(), []

        def client(worker=worker, ask=ask, heard=heard):
            try:
                ask(worker)
            except BaseException as exc:  # noqa: BLE001
                heard.append(exc)
        thread = threading.Thread(target=client)
        thread.start()
        while worker.jobs.qsize() == 0:  # the request's job is queued
            time.sleep(0.01)
        worker.stop()  # after it: a worker that swallowed the Ctrl-C would return here
        with pytest.raises(KeyboardInterrupt):
            worker.run_forever()
        thread.join(timeout=10)
        assert isinstance(heard[0], Stopped) and "stopped" in str(heard[0])


def test_a_port_in_use_is_one_line(served, capsys):
    from gumiho.serve import main

    url, _ = served
    assert main(["--port", url.rsplit(":", 1)[1]]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: cannot listen on 127.0.0.1:")
