"""`gumiho chat`: a conversation whose every answer is plain decoding's answer to the whole
conversation so far, commands that do what they say, the oldest turns left out when the
context fills, and an answer stopped early kept as far as it came."""

import io
import json
import subprocess
import sys

import pytest
import torch

from gumiho import chat
from gumiho.chat import ChatSession, converse
from gumiho.errors import GumihoError

SHIPPED = "gumiho/assets/smollm2/gumiho"


@pytest.fixture(scope="module")
def gen(smollm2):
    from gumiho import SpeculativeGenerator

    return SpeculativeGenerator.load(smollm2, "gumiho", SHIPPED, total_tokens=8)


def plain(target, messages, n):
    """transformers' greedy answer to `messages` (new token ids, stop token kept)."""
    ids = target.chat_ids(messages)
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids], device=target.device),
                                    max_new_tokens=n, do_sample=False)
    new = out[0, len(ids):].tolist()
    stop = next((i for i, t in enumerate(new) if t in target.stop_token_ids), None)
    return new if stop is None else new[:stop + 1]


def talk(session, *lines):
    out, info = io.StringIO(), io.StringIO()
    converse(session, lines, out, info, "gumiho")
    return out.getvalue(), info.getvalue()


def test_each_answer_is_plain_decodings_answer_to_the_conversation(gen):
    """Two turns: the second answer is greedy decoding's on the first turn, its answer and
    the second turn, the template applied to all of them."""
    n = 24
    session = ChatSession(gen, system="You answer briefly.", max_new_tokens=n,
                          reuse_prefix=False)  # each prompt prefilled afresh, as HF's
    answers = []
    for turn in ("Name a primary colour.", "Name another one."):
        sent = session.messages + [{"role": "user", "content": turn}]
        out, info = talk(session, turn)
        result = gen.last_result
        assert result.token_ids == plain(gen.target, sent, n)
        assert out == result.text + "\n" and result.text
        assert info.startswith(f"[gumiho] {result.new_tokens} tokens in {result.cycles} "
                               "cycles, tau")
        answers.append(result)
    assert session.messages == [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": answers[0].text},
        {"role": "user", "content": "Name another one."},
        {"role": "assistant", "content": answers[1].text}]
    assert session.totals.turns == 2
    assert session.totals.new_tokens == sum(a.new_tokens for a in answers)
    assert session.totals.cycles == sum(a.cycles for a in answers)
    verifies = [n for a in answers for n in a.accept_lengths[1:]]
    deepest = max(verifies) - 1
    assert deepest >= 1 and len(session.totals.accepted_at) == deepest
    assert session.totals.accepted_at[0] == sum(n > 1 for n in verifies)
    line = session.totals.line()
    assert f"drafts accepted at depth 1: {sum(n > 1 for n in verifies) / len(verifies):.0%}" \
        in line and f", {deepest}: " in line


def test_the_history_is_reused(gen):
    """By default a turn reuses the cache's entries for the history (prefix.py), and its
    statistics line says how many prompt tokens it spared."""
    session = ChatSession(gen, max_new_tokens=8)
    talk(session, "Name a fruit.")
    history = len(gen.prompt_ids(session.messages))
    _, info = talk(session, "Another one?")
    assert gen.last_result.reused_tokens >= history - 8
    assert f", {gen.last_result.reused_tokens} prompt tokens reused" in info


def test_each_cycle_in_the_other_colour(gen):
    """--show-cycles: the answer's text, each cycle's piece in the other of two colours; as
    many pieces as cycles that showed text (a cycle of several tokens is one piece)."""
    session = ChatSession(gen, max_new_tokens=24, reuse_prefix=False)
    out, info = io.StringIO(), io.StringIO()
    converse(session, ["List three uses of a paperclip."], out, info, "gumiho", True)
    text, result = out.getvalue(), gen.last_result
    plain_text = text
    for code in (*chat.SHADES, chat.RESET):
        plain_text = plain_text.replace(code, "")
    assert plain_text == result.text + "\n" and result.tau > 1.1
    shown = text.count(chat.RESET)
    assert 1 < shown <= result.cycles and text.count(chat.SHADES[1]) == shown // 2


def test_save_and_load_a_conversation(gen, tmp_path):
    """/save writes the conversation as JSON, /load takes it up again (the next answer
    reads it); a missing or foreign file is one error line and changes nothing."""
    session = ChatSession(gen, system="Be brief.", max_new_tokens=6)
    saved = tmp_path / "talk.json"
    _, info = talk(session, "Name a fruit.", f"/save {saved}")
    assert info.splitlines()[-1] == f"(the conversation, 3 messages, saved to {saved})"
    assert json.loads(saved.read_text())["messages"] == session.messages
    kept = list(session.messages)
    _, info = talk(session, "/reset", f"/load {saved}")
    assert session.messages == kept and "3 messages loaded" in info
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "robot", "content": 1}]}')
    for bad, says in ((tmp_path / "none.json", "cannot read"), (tmp_path / "bad.json",
                                                                 "message 0 must be")):
        _, info = talk(session, f"/load {bad}")
        assert info.startswith(f"error: {says}") and info.count("\n") == 1, info
    assert session.messages == kept
    _, info = talk(session, f"/save {tmp_path / 'no' / 'dir.json'}")
    assert info.startswith("error: cannot write")


def test_files_that_hold_no_conversation_are_one_error_line(gen, tmp_path, monkeypatch):
    """Deep JSON, text that is not Unicode, a FIFO: one error line each, nothing changed;
    a conversation with undecodable text typed into it is still saved (escaped)."""
    import os

    session = ChatSession(gen, max_new_tokens=4)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "lone.json").write_text('{"messages": [{"role": "user", '
                                        '"content": "caf\\udce9"}]}')
    os.mkfifo(tmp_path / "fifo")
    for name, says in (("deep.json", "is not JSON"), ("lone.json", "not valid Unicode"),
                       ("fifo", "not a file")):
        _, info = talk(session, f"/load {tmp_path / name}")
        assert info.startswith("error: ") and says in info and info.count("\n") == 1, info
    assert session.messages == []
    session.messages = [{"role": "user", "content": "caf\udce9"}]
    _, info = talk(session, f"/save {tmp_path / 'kept.json'}")
    assert "saved" in info
    assert json.loads((tmp_path / "kept.json").read_text())["messages"] == session.messages
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ is the home folder, as a shell reads it
    _, info = talk(session, "/save ~/home.json")
    assert "saved" in info and (tmp_path / "home.json").is_file()


def test_a_block_is_a_turn_even_when_it_looks_like_a_command(gen, tmp_path):
    """Pasted text between two lines of \"\"\" is asked as it is: a first line that reads
    like a command is not run, and its indentation stays."""
    session = ChatSession(gen, max_new_tokens=4, reuse_prefix=False)
    _, info = talk(session, '"""', f"/save {tmp_path / 'x.json'}", "  is this a command?",
                   '"""', '"""', "    indented()", '"""')
    assert not (tmp_path / "x.json").exists() and "saved" not in info
    asked = [m["content"] for m in session.messages if m["role"] == "user"]
    assert asked == [f"/save {tmp_path / 'x.json'}\n  is this a command?", "    indented()"]


def test_the_oldest_turns_go_whole_whatever_the_loaded_conversation_holds(gen, monkeypatch):
    """A loaded conversation's own system message stays (the session has none), and one
    without a system message under a session with one loses whole turns, never a user
    message without its answer."""
    session = ChatSession(gen, max_new_tokens=8)
    talked = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Name a fruit."},
              {"role": "assistant", "content": "Apple."},
              {"role": "user", "content": "Name a vegetable."},
              {"role": "assistant", "content": "Carrot."}]
    turn = {"role": "user", "content": "Name a tree."}
    for messages, system in ((talked, None), (talked[1:], "Be brief.")):
        session.system = system
        session.messages = list(messages)
        keep = messages[:1] + messages[3:] if system is None else messages[2:]
        room = len(gen.prompt_ids(keep + [turn]))
        monkeypatch.setattr(chat, "context_length", lambda target, room=room: room + 8)
        assert session.fitted(session.messages + [turn]) == keep + [turn]
        assert session.dropped == 1


def test_a_superseded_answer_is_not_kept(gen):
    """Another generation on the same target ends a chat's answer: the conversation and
    the totals do not take that generation's result as the answer's."""
    session = ChatSession(gen, max_new_tokens=8, reuse_prefix=False)
    pieces = session.reply("Name a fruit.")
    next(pieces)
    gen.generate("Give a title.", 3)
    with pytest.raises(GumihoError, match="superseded"):
        list(pieces)
    assert session.messages == [] and session.totals.turns == 0 and session.last is None


def test_ctrl_c_before_an_answer_begins_prints_no_statistics(gen, monkeypatch):
    session = ChatSession(gen, max_new_tokens=4)
    talk(session, "Say hi.")

    def interrupted(self, messages):
        raise KeyboardInterrupt

    monkeypatch.setattr(chat.ChatSession, "fitted", interrupted)
    out, info = talk(session, "Say it again.")
    assert info == "" and out == "\n" and len(session.messages) == 2


def test_turns_of_several_lines():
    """A line is a turn; a block between two lines of three double quotes is one, as is a
    line ending in a backslash with the next; an unclosed block ends with the input."""
    lines = ['Hi there', '"""', 'def f():', '    return 1', '"""', 'first \\', 'second',
             '"""', 'left open']
    assert list(chat.turns(line + "\n" for line in lines)) == [
        "Hi there", "def f():\n    return 1", "first \nsecond", "left open"]


def test_commands(gen):
    session = ChatSession(gen, max_new_tokens=6)
    out, info = talk(session, "Say hi.", "", "  ", "/stats", "/bogus", "/help")
    lines = info.splitlines()
    assert lines[1].startswith("[gumiho] 1 answer, 6 tokens in ")
    assert lines[2].startswith("error: unknown command /bogus: /reset starts")
    assert lines[3] == chat.HELP
    assert len(session.messages) == 2
    out, info = talk(session, "/reset", "/exit", "Say hi.")  # nothing after /exit
    assert info == "(a new conversation)\n" and out == ""
    assert session.messages == [] and session.totals.turns == 1
    # a path-like turn is a question, not a command
    out, _ = talk(session, "/usr/bin is for what?")
    assert out.strip() and len(session.messages) == 2


def test_the_oldest_turns_give_way_to_the_context(gen, monkeypatch):
    """A context that holds the new turn but not the whole conversation: the oldest turns
    are left out (the system message stays) and a note says how many; a turn that alone
    does not fit is one error line and changes nothing."""
    session = ChatSession(gen, system="Be brief.", max_new_tokens=8, reuse_prefix=False)
    talk(session, "Name a fruit.", "Name a vegetable.")
    before = list(session.messages)
    turn = {"role": "user", "content": "Name a tree."}
    room = len(gen.prompt_ids([before[0], *before[3:], turn]))  # the last turn fits alone
    assert room < len(gen.prompt_ids(before + [turn]))
    monkeypatch.setattr(chat, "context_length", lambda target: room + 8)
    out, info = talk(session, "Name a tree.")
    assert "(the 1 oldest turn left out to fit the context)" in info
    assert session.messages[:4] == [before[0], *before[3:], turn]
    assert gen.last_result.token_ids == plain(gen.target, session.messages[:4], 8)

    monkeypatch.setattr(chat.ChatSession, "fitted", lambda self, messages: messages)
    monkeypatch.setattr("gumiho.engine.context_length", lambda target: 10)
    kept = list(session.messages)
    out, info = talk(session, "Name a flower.")
    assert out == "" and info.startswith("error: the prompt is ") and "\n" not in info[:-1]
    assert session.messages == kept and session.totals.turns == 3


def test_an_answer_stopped_early_is_kept_as_far_as_it_came(gen, monkeypatch):
    """Ctrl-C while the answer prints, or while the loop computes: the conversation keeps
    the part the user saw, and `last_result` describes it (stopped_by "closed")."""
    n = 32
    session = ChatSession(gen, max_new_tokens=n, reuse_prefix=False)
    full = plain(gen.target, [{"role": "user", "content": "Count from one to ten."}], n)

    class Impatient(io.StringIO):
        """Ctrl-C once, as the second piece prints."""
        pieces = 0

        def write(self, text):
            self.pieces += 1
            if self.pieces == 2:
                raise KeyboardInterrupt
            return super().write(text)

    info = io.StringIO()
    converse(session, ["Count from one to ten."], Impatient(), info, "gumiho")
    result = gen.last_result
    assert result.stopped_by == "closed" and 0 < result.new_tokens < len(full)
    assert result.token_ids == full[:result.new_tokens]
    assert session.messages[-1] == {"role": "assistant", "content": result.text}
    assert info.getvalue().rstrip().endswith("(stopped)")

    session.reset()
    drafter = gen.drafter_for(0.0)
    calls = []
    real = drafter.propose

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # inside the loop, as Ctrl-C arrives mid-cycle
        return real()

    monkeypatch.setattr(drafter, "propose", interrupted)
    out, info = talk(session, "Count from one to ten.")
    result = gen.last_result
    assert result.stopped_by == "closed" and 0 < result.new_tokens < len(full)
    assert result.token_ids == full[:result.new_tokens]
    assert session.messages[-1]["content"] == result.text


def test_the_command_line(smollm2):
    """`python -m gumiho.chat` with turns on stdin, as a script pipes them: plain decoding's
    answers, each with its statistics, the session's totals at the end."""
    n = 10
    turns = "Name a primary colour.\n/stats\n"
    done = subprocess.run([sys.executable, "-m", "gumiho.chat", "--method", "ar",
                           "--max-new-tokens", str(n), "--dtype", "float32"],
                          input=turns, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    want = smollm2.decode(plain(smollm2, [{"role": "user", "content": turns.split("\n")[0]}],
                                n))
    assert done.stdout == want + "\n"
    info = done.stderr.splitlines()
    assert info[-3].startswith("[ar] ") and info[-2].startswith("[ar] 1 answer, ")
    assert info[-1] == info[-2]
    bad = subprocess.run([sys.executable, "-m", "gumiho.chat", "--target", "/no/such"],
                         input="", capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ")


def test_defaults():
    """A drafter method at the demo preset, on SmolLM2 the drafter shipped for it; another
    target needs --draft; a method without a drafter gets no preset."""
    args = chat.build_parser().parse_args([])
    chat.chat_defaults(args)
    assert (args.method, args.preset) == ("gumiho", "demo")
    assert args.draft.endswith("assets/smollm2/gumiho")
    args = chat.build_parser().parse_args(["--method", "eagle2", "--preset", "reference"])
    chat.chat_defaults(args)
    assert args.preset == "reference" and args.draft.endswith("assets/smollm2/eagle2")
    args = chat.build_parser().parse_args(["--target", "/some/model"])
    with pytest.raises(chat.GumihoError, match="--method gumiho needs --draft"):
        chat.chat_defaults(args)
    args = chat.build_parser().parse_args(["--method", "lookup", "--target", "/some/model"])
    chat.chat_defaults(args)
    assert args.preset is None and args.draft is None


def test_generates_answer_flags_reach_every_answer(gen):
    """--stop, --stop-token-id, --min-tokens, --logit-bias and --no-repeat-ngram-size, as
    `gumiho generate` takes them, are every answer's settings."""
    from gumiho.flags import answer_settings

    args = chat.build_parser().parse_args(["--stop", "\\n", "--logit-bias", "5=-100",
                                           "--min-tokens", "2", "--no-repeat-ngram-size", "3"])
    settings = answer_settings(args)
    assert settings == {"stop": ["\n"], "stop_token_ids": [], "min_tokens": 2,
                        "logit_bias": [(5, -100.0)], "no_repeat_ngram_size": 3}
    session = ChatSession(gen, max_new_tokens=24, reuse_prefix=False, stop=". ")
    talk(session, "Tell me two facts about the sea.")
    assert ". " not in session.messages[-1]["content"]
    assert gen.last_result.stopped_by in ("stop_string", "stop_token")
