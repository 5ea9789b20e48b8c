"""No control character of a user's reaches the terminal: a trace's metadata stored raw by `trace
import` and printed back by `trace stats`, a model name in an error, a bad value in argparse's own
error, a bidirectional override; each is written as an escape (klotski_sim/util/terminal.py)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.util.terminal import one_line, printable

from .conftest import run_cli, run_cli_process

HOSTILE = ("\x1b", "\x07", "\x08", "\r", "\x9b", "\u202e", "\x00")


def _clean(text: str) -> bool:
    return not any(c in text for c in HOSTILE)


def test_a_traces_metadata_is_escaped_where_it_is_read_back(tmp_path):
    lines = [
        json.dumps({"seq_id": 0, "token_idx": t, "layer": layer, "experts": [t % 4, (t + 1) % 4]})
        for t in range(4)
        for layer in range(2)
    ]
    (tmp_path / "log.jsonl").write_text("\n".join(lines))
    source, license_ = "\x1b[31mred\rOVERWRITTEN\u202etxt.exe", "\x07\x08\x1b]0;title\x07"
    rc, _, err = run_cli(
        "trace", "import", str(tmp_path / "log.jsonl"), "--model", "tiny-mixtral", "--source", source,
        "--license", license_, "--out", str(tmp_path / "t.npz"),
    )  # fmt: skip
    assert rc == 0, err
    rc, out, err = run_cli("trace", "stats", str(tmp_path / "t.npz"))
    assert rc == 0, err
    assert _clean(out) and _clean(err), out
    assert "source: \\x1b[31mred\\rOVERWRITTEN\\u202etxt.exe;" in out


def test_errors_and_argparse_messages_escape_what_the_user_typed():
    rc, out, err = run_cli("simulate", "--model", "bad\x1b[2Jname\u202e")
    assert rc == 2 and _clean(err) and "\\x1b[2J" in err and err.count("\n") == 1, err
    rc, out, err = run_cli_process("simulate", "--batch-size", "1\x1b]0;owned\x07")
    assert rc == 2 and _clean(err) and "\\x1b]0;owned\\x07" in err, err


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_printable_keeps_lines_and_tabs_and_escapes_every_other_control_character(text):
    shown = printable(text)
    assert not any(ord(c) < 32 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0 for c in shown)
    assert shown.count("\n") == text.count("\n") and shown.count("\t") == text.count("\t")
    line = one_line(text)
    assert "\n" not in line and "\t" not in line
    assert printable("plain text, ünïcödé") == "plain text, ünïcödé"
