"""Review of `gumiho serve` and `gumiho chat` (session 66): a request without max_tokens
takes what the context leaves, OpenAI's `bytes` of a character split across tokens, seeds
and vLLM's top_k -1 taken as those APIs take them, booleans that are not booleans refused,
refusals that name the request's own fields and flags, and /save or /load without a file."""

import io
import json
import types
import urllib.error
import urllib.request

import pytest

PROMPT = [{"role": "user", "content": "Say hi"}]


def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read().decode())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def test_a_request_without_max_tokens_gets_what_the_context_leaves(served, monkeypatch):
    """The server's --max-tokens default is not the client's ask: a prompt that leaves less
    room in the context gets that room, not a 400 asking for fewer tokens it never named
    (as vLLM's default); a named max_tokens past the room is still refused."""
    import gumiho.engine
    import gumiho.serve

    url, gen = served
    ids = gen.prompt_ids(PROMPT)
    context = lambda target: len(ids) + 6  # noqa: E731 (6 tokens of room)
    monkeypatch.setattr(gumiho.engine, "context_length", context)
    monkeypatch.setattr(gumiho.serve, "context_length", context)
    body = {"messages": PROMPT, "temperature": 0, "ignore_eos": True}
    status, out = post(url + "/v1/chat/completions", body)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["finish_reason"] == "length"
    status, out = post(url + "/v1/chat/completions", {**body, "max_tokens": 7})
    assert status == 400 and "ask for at most 6" in out["error"]["message"]


def test_the_bytes_of_a_character_split_across_tokens(smollm2):
    """OpenAI's `bytes` are each token's own UTF-8 bytes, which join into the characters
    that span tokens (decoded alone such a token is U+FFFD, whose bytes they were)."""
    from gumiho.serve import Server

    text = "🎉 日本 café"
    ids = smollm2.tokenizer(text).input_ids
    assert any(smollm2.decode([i]) == "\ufffd" for i in ids)  # a character split
    server = Server(types.SimpleNamespace(target=smollm2), "smollm2", 8, "ar", worker=None)
    result = types.SimpleNamespace(token_ids=ids, logprobs=[0.0] * len(ids),
                                   top_logprobs=[[(i, 0.0)] for i in ids])
    content = server.chat_logprobs(result)["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == text
    assert bytes(b for c in content for b in c["top_logprobs"][0]["bytes"]).decode() == text
    assert [c["token"] for c in content] == [smollm2.decode([i]) for i in ids]


def test_any_integer_seed_and_vllms_top_k_minus_one_are_taken(served):
    """OpenAI and vLLM take any integer as a seed (a negative one too), and vLLM's top_k
    -1 means all tokens (0 here)."""
    url, _ = served
    body = {"messages": PROMPT, "max_tokens": 4, "temperature": 0.8}
    status, negative = post(url + "/v1/chat/completions", {**body, "seed": -5})
    assert status == 200, negative
    status, same = post(url + "/v1/chat/completions", {**body, "seed": -5 % 2**63})
    assert negative["choices"][0]["message"] == same["choices"][0]["message"]
    status, all_k = post(url + "/v1/chat/completions", {**body, "seed": 3, "top_k": -1})
    assert status == 200, all_k
    status, zero = post(url + "/v1/chat/completions", {**body, "seed": 3, "top_k": 0})
    assert all_k["choices"][0]["message"] == zero["choices"][0]["message"]


@pytest.mark.parametrize("path, extra, says", [
    ("/v1/chat/completions", {"stream": "false"}, "stream must be true or false"),
    ("/v1/completions", {"stream": 1}, "stream must be true or false"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs must be true or false"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "no"}},
     "include_usage must be true or false"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ("/v1/completions", {"max_completion_tokens": "8"},
     "max_completion_tokens must be an integer >= 1"),
])
def test_fields_are_refused_by_their_own_names(served, path, extra, says):
    """A "false" that would stream, a field refused under generate's name for it: a 400
    naming the request's field."""
    url, _ = served
    prompt = {"messages": PROMPT} if "chat" in path else {"prompt": "Hi"}
    status, out = post(url + path, {**prompt, "max_tokens": 4, **extra})
    assert status == 400 and says in out["error"]["message"], out


def test_serves_flags_are_checked_by_their_own_names(capsys):
    """--port past 65535 is a usage error (it was an internal error from bind), and a
    --max-tokens that fills the context names --max-tokens (not generate's flag)."""
    from gumiho.serve import build_parser, main

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--port", "99999"])
    assert exit_.value.code == 2
    assert "port number from 0 to 65535" in capsys.readouterr().err
    assert main(["--max-tokens", "9000"]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 9000 leaves no room" in err and "--max-new-tokens" not in err


def test_save_or_load_without_a_file_says_so():
    """/save and /load need a file: said as such, not as an unknown command."""
    from gumiho.chat import ChatSession, converse

    info = io.StringIO()
    converse(ChatSession(gen=None), ["/save", "/load  "], io.StringIO(), info, "ar")
    assert info.getvalue().splitlines() == ["error: /save needs a file: /save FILE",
                                            "error: /load needs a file: /load FILE"]


def test_text_offsets_count_characters_not_token_pieces(smollm2):
    """Completions' text_offset: where each token begins in the text, a character split
    across tokens counted once (each of its tokens, alone U+FFFD, counted one each);
    streamed in cycles, the offsets go on from chunk to chunk."""
    from gumiho.serve import Server, TextOffsets

    text = "🎉 日本 café!"
    ids = smollm2.tokenizer(text).input_ids
    server = Server(types.SimpleNamespace(target=smollm2), "smollm2", 8, "ar", worker=None)

    def result(tokens):
        return types.SimpleNamespace(token_ids=tokens, logprobs=[0.0] * len(tokens),
                                     top_logprobs=None)
    whole = server.text_logprobs(result(ids))["text_offset"]
    assert max(whole) < len(text)
    for at, token in zip(whole, ids, strict=True):
        piece = smollm2.decode([token])
        if "\ufffd" not in piece:  # a whole token's text lies where its offset says
            assert text[at:at + len(piece)] == piece
    offsets = TextOffsets()
    streamed = [o for cut in (ids[:2], ids[2:4], ids[4:]) for o in
                server.text_logprobs(result(cut), offsets)["text_offset"]]
    assert streamed == whole
