"""Reading the chat's input, without a terminal: the key decoder and the line editor
(`console/line_editor.py`), and which reply a Ctrl-C stops (`console/terminal.py`'s
Console). Through a real terminal: test_chat_tty.py."""

from __future__ import annotations


def test_key_decoder():
    from llama_tp.console.terminal import KeyDecoder

    d = KeyDecoder()
    keys = d.feed(b"ab\x1b[A\x1b[3~\r\n\x7f\x03\x04\x1bOH")
    assert keys == ["a", "b", "up", "delete", "enter", "backspace", "ctrl-c", "ctrl-d", "home"]
    assert keys + d.feed(b"") == keys
    assert d.feed(b"\x01\x17\n") == ["home", "kill-word", "enter"]
    assert d.feed(b"\x1b") == [] and d.feed(b"[B") == ["down"]  # split escape sequence
    e = "é".encode()
    assert d.feed(e[:1]) == [] and d.feed(e[1:]) == ["é"]  # split UTF-8 character
    assert d.feed(b"\x1b[15~x\x1b[200~y") == ["x", "y"]  # unknown keys are dropped


def test_line_editor():
    from llama_tp.console.terminal import EOF, LineEditor

    out = []
    ed = LineEditor(out.append)

    def line(keys, prompt=">> "):
        ed.start(prompt)
        for k in keys:
            result = ed.key(k)
            if result is not None:
                return result
        return None

    assert line(["h", "i", "left", "x", "end", "!", "enter"]) == "hxi!"
    assert out[0] == ">> " and out[-1] == "\n"
    assert line(["a", "b", "home", "ctrl-d", "enter"]) == "b"  # Ctrl-D deletes at the cursor
    assert line(["up", "up", "enter"]) == "hxi!"  # history, newest first
    assert line(["up", "down", "enter"]) == ""
    assert line(list("one two") + ["kill-word", "enter"]) == "one "
    assert line(list("abc") + ["ctrl-c"]) is None and out[-2:] == ["^C\n", ">> "]
    assert line(["x", "backspace", "ctrl-d"]) is EOF  # Ctrl-D on an empty line
    assert ed.history == ["hxi!", "b", "hxi!", "one "]  # a recalled line goes to the end


def test_console_ctrl_c_stops_the_reply_to_the_line_it_follows(monkeypatch):
    from llama_tp.cluster.distributed import world
    from llama_tp.console.terminal import Console

    monkeypatch.setenv("LLAMA_TP_TERMINAL", "lines")
    c = Console(world())  # not entered: no stdin thread, the input is fed by hand
    assert c.mode == "lines"
    c._on_lines(b"a\n")
    assert c.read_line() == "a" and not c.interrupted()
    with c.replying():
        c._on_lines(b"\x03")  # during the reply to 'a'
        assert c.interrupted()
    c._on_lines(b"b\n\x03")  # right after 'b' was sent, before its turn began
    assert c.read_line() == "b" and c.interrupted()
    with c.replying():
        pass
    c._on_lines(b"c\n")
    assert c.read_line() == "c" and not c.interrupted()
    with c.replying():
        pass
    c._on_lines(b"\x03d\n")  # at the prompt: nothing to stop
    assert c.read_line() == "d" and not c.interrupted()
    c._on_lines(b"\x04")
    assert c.read_line() is None
