"""`colibri repl`: chat with the model; the conversation is kept across turns.

Answers stream as they are generated. The daemon keeps the conversation's KV cache
(`conv=`), so a follow-up turn prefills only the new message. Enter sends; a message
that starts with \"\"\" continues until a line ending with \"\"\" (multi-line input), and
Alt-Enter (Esc, Enter) inserts a newline. Ctrl-C cancels the answer in progress (or
clears the line); Ctrl-D leaves. History persists in $COLIBRI_HOME/repl_history.

A REPL left open outlives what the user stops elsewhere, and never undoes it without a
word: a daemon stopped under it (`colibrid stop`) is started again only when the user
says yes (on a terminal; a piped session says it starts one), and a model unloaded under
it (`colibri stop`, keep_alive) is announced before the message that loads it again.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from colibri_protocol import home
from colibri_protocol.codec import encode_line
from colibri_protocol.messages import Data, Done, Submit

from colibri_cli.client import (
    Client,
    ClientError,
    ConnectionLost,
    NotRunning,
    ensure_daemon,
    is_remote,
    model_name,
)
from colibri_cli.options import add_answer_options, chat_sampling
from colibri_cli.render import ProgressLine, prefill_rate

HELP = """commands:
  /help                 this help
  /reset                forget the conversation
  /system TEXT          set the system message (and reset)
  /set NAME VALUE       temperature, top_p, top_k, max_tokens, seed, repeat_penalty,
                        repeat_last_n, frequency_penalty, presence_penalty, min_p
  /profile NAME         make NAME the daemon's active profile; count turns into it
                        (`/profile NAME --create` starts one that does not exist yet)
  /stats                statistics of the last answer
  /quit                 leave (so does Ctrl-D)
Ctrl-C cancels an answer in progress. Start a message with \"\"\" for several lines."""

SETTABLE: dict[str, Callable[[str], object]] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_tokens": int,
    "seed": int,
    "repeat_penalty": float,
    "repeat_last_n": int,
    "frequency_penalty": float,
    "presence_penalty": float,
    "min_p": float,
}


@dataclass
class Chat:
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    options: dict[str, object] = field(
        default_factory=lambda: {"max_tokens": 512, "temperature": 0.0}
    )
    profile: str | None = None
    model: str | None = None
    turn: int = 0
    last: Done | None = None

    @property
    def conv(self) -> str:
        return f"repl{os.getpid()}-{self.turn}"

    def reset(self) -> None:
        self.messages.clear()
        self.turn += 1  # a new conversation key: the daemon's KV is not reused

    def request(self, rid: str, text: str) -> Submit:
        prefix = [{"role": "system", "content": self.system}] if self.system else []
        turn = [*self.messages, {"role": "user", "content": text}]
        return Submit(
            rid,
            messages=tuple(prefix + turn),
            conv=self.conv,
            profile=self.profile,
            model=model_name(self.model),
            **self.options,
        )  # type: ignore[arg-type]


def stream_answer(client: Client, chat: Chat, text: str) -> None:
    """The answer to one message; a lost daemon raises ConnectionLost (the caller
    reconnects and asks again)."""
    rid = client.next_id()
    answer: list[str] = []
    status = ProgressLine(sys.stdout)
    try:
        for event in status.around(client.generate(chat.request(rid, text))):
            if isinstance(event, Data):
                answer.append(event.text)
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Done):
                chat.last = event
        sys.stdout.write("\n")
        chat.messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "".join(answer)},
        ]
    except KeyboardInterrupt:
        status.clear()
        client.cancel(rid)
        print("\n(cancelled)")
    except ConnectionLost:
        status.clear()
        if answer:
            sys.stdout.write("\n")
        raise
    except ClientError as exc:
        print(f"\nerror: {exc}")


def say_if_unloaded(client: Client, chat: Chat) -> None:
    """Before a message: when the daemon holds no model (`colibri stop`, or keep_alive ran
    out while the REPL sat open), say that this message loads one, rather than reloading
    it in silence. Not when the REPL itself asked to unload after each answer, nor for a
    remote model (`colibri pull URL`): its endpoint answers, and the daemon loads nothing."""
    if chat.options.get("keep_alive") == 0 or is_remote(chat.model):
        return
    status = client.query("STATUS")
    if isinstance(status, dict) and status.get("model") is None and not status.get("loading"):
        what = chat.model or "the default model"
        print(f"colibri: no model is loaded (`colibri stop` or keep_alive); loading {what}")


def may_restart() -> bool:
    """Whether to start the daemon again after it stopped under the REPL (most likely
    the user's `colibrid stop`): asked on a terminal (Enter is yes); a piped session
    cannot be asked without eating a line of its input, so it says it starts one."""
    if not sys.stdin.isatty():
        print("colibri: the daemon was stopped; starting it again (stdin is no terminal)")
        return True
    try:
        answer = input("colibri: the daemon was stopped; start it again? [Y/n] ")
    except (EOFError, KeyboardInterrupt):
        print()
        return False
    return answer.strip().lower() in ("", "y", "yes")


def reopen(model: str | None) -> Client | None:
    """A new connection after the daemon went away: one that answers (restarted
    meanwhile) is used; with none running, a new one only if `may_restart` (None: the
    user said no, and the message is not sent)."""
    print("colibri: lost the daemon; reconnecting")
    try:
        client = Client.connect()
    except NotRunning:
        if not may_restart():
            print("(not sent; the daemon stays stopped: send a message to be asked again)")
            return None
        client = ensure_daemon(model, stderr=sys.stdout)
    print("colibri: reconnected to the daemon")
    return client


def command(client: Client, chat: Chat, line: str) -> bool:
    """Run a slash command; False means leave."""
    name, _, rest = line[1:].partition(" ")
    rest = rest.strip()
    if name in ("quit", "exit", "bye"):
        return False
    if name == "help":
        print(HELP)
    elif name == "reset":
        chat.reset()
        print("(conversation cleared)")
    elif name == "system":
        chat.system = rest or None
        chat.reset()
        print(f"(system message {'set' if rest else 'cleared'}; conversation cleared)")
    elif name == "set":
        key, _, value = rest.partition(" ")
        if key not in SETTABLE:
            print(f"/set what? one of {', '.join(SETTABLE)}")
        else:
            try:
                chat.options[key] = SETTABLE[key](value)
                print(f"({key} = {chat.options[key]})")
            except ValueError:
                print(f"not a valid {key}: {value!r}")
    elif name == "profile":
        if not rest:
            print(f"(profile: {chat.profile or 'the active one'})")
        else:
            name, _, flag = rest.partition(" ")
            extra = ["CREATE"] if flag.strip() == "--create" else []
            try:
                client.call(encode_line("PROFILE", "USE", name, *extra), want=("OK",))
                chat.profile = name
                print(f"(active profile: {name})")
            except ConnectionLost:
                raise
            except (ClientError, ValueError) as exc:
                print(f"error: {exc}")
    elif name == "stats":
        done = chat.last
        if done is None:
            print("(no answer yet)")
        else:
            print(
                f"{done.prompt_tokens} prompt tokens ({done.extras.get('cached', 0)} cached), "
                f"{done.emitted} generated tokens, {done.tok_s:.1f} tok/s, "
                f"{prefill_rate(done.extras)}, "
                f"hit rate {done.hit_pct:.1f}%, finish={done.finish}"
            )
    else:
        print(f"unknown command /{name}; /help lists them")
    return True


def private_file(path: Path) -> None:
    """Create `path` readable by its owner only (0600), or make an existing one so."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def make_reader() -> Callable[[], str]:
    """prompt-toolkit with history and multi-line input on a terminal; plain lines else."""
    if not sys.stdin.isatty():

        def plain() -> str:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line.rstrip("\n")

        return plain
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("enter")
    def _(event) -> None:  # type: ignore[no-untyped-def]
        buf = event.current_buffer
        text = buf.text
        open_block = text.lstrip().startswith('"""') and not (
            len(text.strip()) > 3 and text.rstrip().endswith('"""')
        )
        buf.insert_text("\n") if open_block else buf.validate_and_handle()

    @keys.add("escape", "enter")
    def _(event) -> None:  # type: ignore[no-untyped-def]
        event.current_buffer.insert_text("\n")

    history = home.colibri_home() / "repl_history"
    history.parent.mkdir(parents=True, exist_ok=True)
    private_file(history)  # what was typed: as private as the kept KV
    session: PromptSession[str] = PromptSession(
        history=FileHistory(str(history)), key_bindings=keys, multiline=True
    )

    def ask() -> str:
        return session.prompt(">>> ", prompt_continuation="... ")

    return ask


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri repl", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", metavar="NAME|DIR", help="installed model or container (default: the daemon's)"
    )
    p.add_argument("--profile", metavar="NAME", help="switch the daemon to this usage profile")
    add_answer_options(p, max_tokens=512, temperature=0.0)
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        client = ensure_daemon(args.model)
    except ClientError as exc:
        print(f"colibri repl: {exc}", file=sys.stderr)
        return 1
    chat = Chat(
        system=args.system,
        profile=args.profile,
        model=args.model,
        options={"max_tokens": args.max_tokens, "temperature": args.temperature}
        | chat_sampling(args)
        | ({} if args.keep_alive is None else {"keep_alive": args.keep_alive}),
    )
    read = make_reader()
    print("colibri repl: /help for commands, Ctrl-D to leave")
    conn: Client | None = client
    try:
        while True:
            try:
                line = read()
            except KeyboardInterrupt:
                continue
            except EOFError:
                return 0
            text = line.strip()
            if text.startswith('"""'):
                text = text.strip('"').strip()
            if not text:
                continue
            for attempt in (1, 2):  # a daemon that went away: reconnect, then once more
                try:
                    if conn is None and (conn := reopen(args.model)) is None:
                        break
                    if text.startswith("/"):
                        if not command(conn, chat, text):
                            return 0
                    else:
                        say_if_unloaded(conn, chat)
                        stream_answer(conn, chat, text)
                    break
                except ConnectionLost:
                    if conn is not None:
                        conn.close()
                        conn = None
                    if attempt == 2:
                        print("error: the daemon went away again; the next line reconnects")
                except ClientError as exc:  # no daemon could be reached or started
                    print(f"error: {exc}")
                    break
    finally:
        if conn is not None:
            conn.close()
