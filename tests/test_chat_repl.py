"""`metrale chat` driven through a pseudo-terminal, as a person at a keyboard drives it: Ctrl-C
mid-reply returns to the prompt (and the engine goes on), `/exit` exits 0, `/clear` and
`/system` are commands and never reach the model, and a conversation that fills the context
keeps going with its oldest turns dropped."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from metrale import LLM, SamplingParams
from metrale.chat_repl import ChatSession


def _controlling_tty() -> None:
    """In the child: a session of its own whose controlling terminal is the pty (stdin), so
    that Ctrl-C typed there reaches it as SIGINT, as at a real terminal."""
    import fcntl
    import termios

    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    def __init__(self, *args: str, home) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "METRALE_HOME": str(home), "TERM": "dumb"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metrale.cli", "chat", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            preexec_fn=_controlling_tty,
        )
        os.close(slave)
        self.seen = ""

    def poll(self) -> None:
        ready, _, _ = select.select([self.master], [], [], 0.2)
        if ready:
            self.seen += os.read(self.master, 4096).decode(errors="replace")

    def read_until(self, text: str, timeout: float = 120) -> str:
        deadline = time.time() + timeout
        while text not in self.seen:
            assert time.time() < deadline, f"waited for {text!r}; saw {self.seen[-500:]!r}"
            self.poll()
        return self.seen

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())


def test_ctrl_c_stops_the_reply_and_exit_leaves_cleanly(tiny_model_dir, tmp_path):
    args = ("--model", str(tiny_model_dir), "--max-tokens", "1000", "--ignore-eos")
    term = Terminal(*args, "--max-model-len", "1024", home=tmp_path)
    try:
        term.read_until("you> ")
        term.send("/system be brief\n")
        term.read_until("(system prompt set)")
        term.send("tell me everything\n")
        start = len(term.read_until("assistant> "))
        while len(term.seen) < start + 20:  # the reply is under way
            term.poll()
        term.send("\x03")  # Ctrl-C mid-reply
        term.read_until("[stopped]")
        term.read_until("you> ")
        term.send("/clear\n")
        term.read_until("(conversation cleared)")
        term.send("/exit\n")
        assert term.proc.wait(60) == 0
        assert "Traceback" not in term.seen
    finally:
        term.proc.kill()


@pytest.fixture(params=["max_model_len", "kv_pool"])
def small_llm(tiny_model_dir, request):
    """A context of 96 tokens, or one the KV pool sets below max_model_len (the REPL read
    max_model_len and sent turns the pool could not hold)."""
    if request.param == "kv_pool":
        pool = dict(max_model_len=256, page_size=4, num_kv_pages=26)
        llm = LLM(tiny_model_dir, device="cpu", **pool)
        assert llm.engine.context_len < 120
        return llm
    return LLM(tiny_model_dir, device="cpu", max_model_len=96)


def test_a_conversation_that_fills_the_context_keeps_going(small_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    session = ChatSession(small_llm, params, system="sys")
    dropped_total = 0
    for turn in range(12):
        session.turns.append({"role": "user", "content": f"message number {turn} " * 3})
        dropped_total += session.fit()
        assert session.prompt_tokens() + 8 <= small_llm.engine.context_len
        session.reply(out=open(os.devnull, "w"))  # noqa: SIM115
    assert dropped_total > 0
    assert session.messages()[0] == {"role": "system", "content": "sys"}  # the system stays
    assert not small_llm.engine.has_unfinished_requests()


def test_a_message_too_long_alone_keeps_the_history(small_llm):
    import io

    from metrale.chat_repl import say

    session = ChatSession(small_llm, SamplingParams(temperature=0.0, max_tokens=4))
    say(session, "short one", io.StringIO())
    say(session, "short two", io.StringIO())
    before = list(session.turns)
    out = io.StringIO()
    say(session, "word " * 500, out)
    assert session.turns == before and "does not fit" in out.getvalue()


def test_undecodable_input_and_an_oversized_system_prompt_are_said_not_raised(small_llm):
    """A line of bytes stdin could not decode (lone surrogates) is refused and the session goes
    on; a system prompt that alone fills the context is named as the cause (found in review:
    a TypeError, and the user's message blamed)."""
    import io

    from metrale.chat_repl import say

    session = ChatSession(small_llm, SamplingParams(temperature=0.0, max_tokens=4))
    out = io.StringIO()
    say(session, "hi \udcff there", out)
    assert "not valid UTF-8" in out.getvalue() and session.turns == []
    say(session, "short one", io.StringIO())
    assert len(session.turns) == 2
    session.system = "word " * 500
    out = io.StringIO()
    say(session, "short two", out)
    assert "system prompt alone does not fit" in out.getvalue() and len(session.turns) == 2


def test_dropping_keeps_the_roles_alternating(small_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    session = ChatSession(small_llm, params)
    for turn in range(10):
        session.turns.append({"role": "user", "content": f"message number {turn} " * 3})
        session.fit()
        assert session.turns[0]["role"] == "user"
        roles = [m["role"] for m in session.turns]
        assert all(a != b for a, b in zip(roles, roles[1:], strict=False))
        session.reply(out=open(os.devnull, "w"))  # noqa: SIM115


def test_an_engine_whose_ranks_are_gone_ends_the_chat(small_llm, monkeypatch):
    """A tensor-parallel engine that stopped (a worker died, a second Ctrl-C mid-forward) can
    answer no later turn: the chat says so once and exits 1, instead of printing the same
    error at every prompt (found in review)."""
    import io

    from metrale.chat_repl import run_repl
    from metrale.distributed.parallel import DistributedError

    def stopped(*args, **kwargs):
        raise DistributedError("the tensor-parallel engine stopped after an earlier failure")

    monkeypatch.setattr(small_llm, "chat", stopped)
    out = io.StringIO()
    stdin = io.StringIO("hello\nagain\n")
    params = SamplingParams(temperature=0.0, max_tokens=4)
    assert run_repl(small_llm, params, stdin=stdin, out=out) == 1
    text = out.getvalue()
    assert text.count("the engine has stopped") == 1
    assert stdin.read() == "again\n"  # the next line was never read


def test_a_message_the_template_refuses_is_said_and_the_chat_goes_on(tiny_model_dir, tmp_path):
    """A chat template that raises for one message (`raise_exception`) ended the REPL and the
    conversation (found in review); a template with a syntax error was a raw jinja2 traceback
    rather than a ValueError. Now the turn is reported and the next one is answered."""
    import io
    import json
    import shutil

    from metrale.chat_repl import say

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    picky = (
        "{% for m in messages %}{% if m.content == 'bad' %}{{ raise_exception('no bad words') }}"
        "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    )
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": picky}))
    llm = LLM(model, device="cpu", max_model_len=256)
    session = ChatSession(llm, SamplingParams(temperature=0.0, max_tokens=4))
    out = io.StringIO()
    say(session, "bad", out)
    assert "no bad words" in out.getvalue() and session.turns == []
    say(session, "hello", out)
    assert [t["role"] for t in session.turns] == ["user", "assistant"]
    broken = {**config, "chat_template": "{% for m in messages %}{{ m.content }"}
    (model / "tokenizer_config.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="^chat template: "):
        LLM(model, device="cpu", max_model_len=256).chat([{"role": "user", "content": "hi"}])


def test_a_bad_byte_on_a_strict_stdin_refuses_its_line_alone(small_llm):
    """Under a strict locale (en_US.UTF-8) stdin decoded a whole chunk at once: one invalid
    byte dropped the lines around it and read as the end of input, exit 0 with nothing
    answered (found in review). Now that line alone is refused and the others answered."""
    import io

    from metrale.chat_repl import run_repl

    stdin = io.TextIOWrapper(io.BytesIO(b"hello\nab\xffcd\nbye\n"), "utf-8", errors="strict")
    out = io.StringIO()
    params = SamplingParams(temperature=0.0, max_tokens=3)
    assert run_repl(small_llm, params, stdin=stdin, out=out) == 0
    text = out.getvalue()
    assert text.count("not valid UTF-8 text") == 1
    assert text.count("assistant> ") == 2  # hello and bye answered
    assert text.index("assistant> ") < text.index("not valid") < text.rindex("assistant> ")
