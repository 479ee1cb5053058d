"""`metrale chat`: a multi-turn REPL over the chat template.

On a terminal the prompt has line editing and history (the standard library's readline, no
extra dependency). Ctrl-C during a reply stops it (the request is aborted, its pages return) and
keeps what was said so far; Ctrl-C at the prompt clears the line; Ctrl-D or `/exit` leaves.
`/clear` forgets the conversation (the system prompt stays), `/system TEXT` sets the system
prompt, `/help` lists the commands. When the conversation no longer fits the context with room
for a reply, the oldest turns are dropped, and the REPL says so.
"""

from __future__ import annotations

import sys

from metrale.distributed.parallel import DistributedError

HELP = "/exit  leave | /clear  forget the conversation | /system TEXT  set the system prompt"


class ChatSession:
    """The conversation and the context arithmetic, apart from any terminal."""

    def __init__(self, llm, params, system: str | None = None) -> None:
        self.llm, self.params = llm, params
        self.system = system
        self.turns: list[dict] = []  # user / assistant messages, oldest first

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def prompt_tokens(self) -> int:
        tok = self.llm.tokenizer
        text = tok.apply_chat_template(self.messages(), add_generation_prompt=True)
        return len(tok.encode(text, add_special_tokens=False))

    def reply_room(self) -> int:
        limit = self.llm.engine.context_len
        return min(self.params.max_tokens or 256, limit // 4)

    def fits_alone(self, message: dict) -> bool:
        """Whether `message` with the system prompt alone leaves room for a reply."""
        kept, self.turns = self.turns, [message]
        try:
            return self.prompt_tokens() + self.reply_room() <= self.llm.engine.context_len
        finally:
            self.turns = kept

    def fit(self) -> int:
        """Drop the oldest exchanges (a user turn and the reply to it, so that roles keep
        alternating) until the prompt leaves room for a reply; returns how many messages were
        dropped. The newest user turn always stays."""
        limit, dropped = self.llm.engine.context_len, 0
        while len(self.turns) > 1 and self.prompt_tokens() + self.reply_room() > limit:
            pair = 2 if len(self.turns) > 2 and self.turns[1]["role"] == "assistant" else 1
            del self.turns[:pair]
            dropped += pair
        return dropped

    def reply(self, out=sys.stdout) -> str:
        """Stream the assistant's reply to `out`; Ctrl-C stops it (what came so far stays)."""
        text, stream = "", self.llm.chat(self.messages(), self.params, stream=True)
        try:
            for chunk in stream:
                delta = chunk.outputs[0].delta_text
                text += delta
                out.write(delta)
                out.flush()
        except KeyboardInterrupt:
            stream.close()  # aborts the request
            out.write(" [stopped]")
        out.write("\n")
        out.flush()
        self.turns.append({"role": "assistant", "content": text})
        return text


def run_repl(llm, params, system: str | None = None, stdin=sys.stdin, out=sys.stdout) -> int:
    if system is not None and not _is_text(system):
        raise ValueError("--system: not valid UTF-8 text")
    session = ChatSession(llm, params, system)
    interactive = stdin.isatty()
    if getattr(stdin, "errors", None) == "strict" and hasattr(stdin, "reconfigure"):
        # A strict locale's stdin decodes a whole chunk at a time: one bad byte dropped the
        # lines around it and read as the end of input (found in review). Read as lone
        # surrogates instead, the line alone is refused (`_is_text`).
        stdin.reconfigure(errors="surrogateescape")
    if interactive:
        import readline  # noqa: F401 (line editing and history for input())

        print(f"metrale chat ({HELP})", file=out)
    while True:
        try:
            line = input("you> ") if interactive else stdin.readline()
        except KeyboardInterrupt:  # clears the line, as a shell does
            out.write("\n")
            continue
        except EOFError:
            break
        except UnicodeDecodeError:  # (a strict stream that cannot be reconfigured)
            print("(that line is not valid UTF-8 text; nothing was sent)", file=out)
            continue
        if not interactive and not line:
            break
        line = line.rstrip("\n")
        command = line.strip()
        if not command:
            continue
        word = command.split()[0]  # ("/exit now" exits, "/help me" helps)
        if word in ("/exit", "/quit"):
            break
        if word == "/help":
            print(HELP, file=out)
            continue
        if word == "/clear":
            session.turns.clear()
            print("(conversation cleared)", file=out)
            continue
        if command == "/system" or command.startswith("/system "):
            if not _is_text(command):
                print("(that system prompt is not valid UTF-8 text; it is unchanged)", file=out)
                continue
            session.system = command[len("/system") :].strip() or None
            print("(system prompt set)" if session.system else "(system prompt cleared)", file=out)
            continue
        if word[:1] == "/" and word[1:].isalpha():  # (a path such as /usr/lib is a message)
            # a mistyped command went to the model as the user's message (review)
            print(f"(unknown command {word}; /help lists them)", file=out)
            continue
        try:
            say(session, line, out)
        except KeyboardInterrupt:  # between the reply's chunks, or before it started
            out.write("\n(interrupted)\n")
        except DistributedError as e:  # its ranks are gone: no later turn could be answered
            print(f"\n(error: {e}; the engine has stopped)", file=out)
            return 1
    return 0


def _is_text(line: str) -> bool:
    """Whether `line` is text a tokenizer takes: not undecodable input bytes (stdin reads
    them as lone surrogates), on which the tokenizer raised a TypeError (found in review)."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def say(session: ChatSession, line: str, out) -> None:
    """One user turn and the reply to it; a turn that fails (a template that refuses the
    history, say) is reported and undone, and the session goes on."""
    if not _is_text(line):
        print("(that line is not valid UTF-8 text; nothing was sent)", file=out)
        return
    message = {"role": "user", "content": line}
    try:
        fits = session.fits_alone(message)
        # (the system prompt is part of it: name it when it alone leaves no room)
        system_fits = (
            fits or not session.system or session.fits_alone({"role": "user", "content": ""})
        )
    except ValueError as e:  # the template refused the message (review: it ended the REPL)
        print(f"(error: {e}; nothing was sent)", file=out)
        return
    if not fits:
        whose = "with the system prompt " if session.system else ""
        if not system_fits:
            print(
                "(the system prompt alone does not fit the context; /system changes it)", file=out
            )
            return
        print(f"(that message {whose}does not fit the context; nothing was sent)", file=out)
        return
    session.turns.append(message)
    try:
        dropped = session.fit()
        if dropped:
            print(f"(dropped the {dropped} oldest messages to fit the context)", file=out)
        out.write("assistant> ")
        out.flush()
        session.reply(out)
    except (KeyboardInterrupt, DistributedError):
        if session.turns and session.turns[-1] is message:
            session.turns.pop()  # no reply to it: keep the roles alternating
        raise
    except (ValueError, RuntimeError) as e:
        if session.turns and session.turns[-1] is message:
            session.turns.pop()
        print(f"\n(error: {e})", file=out)
