"""`dsgraph serve`'s command line, without starting a server: its help names every default, and a
missing extra, a taken port or no model is one line (exit 2) before any weight is read."""
from __future__ import annotations

import socket
import sys

import pytest

from runtime.cli import build_parser, main


def one_line_error(capsys, *words) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def test_help_lists_every_option_with_its_default(capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    formatter = sub.formatter_class(prog="dsgraph serve")
    for action in sub._actions:
        if action.option_strings and action.dest != "help" and action.default is not False:   # flags: off
            assert "default" in formatter._get_help_string(action) % vars(action), action.option_strings
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--shutdown-timeout" in capsys.readouterr().out


def test_max_num_seqs_default_is_the_engines():
    from runtime.cli_serve import MAX_NUM_SEQS
    from runtime.engine import DEFAULT_MAX_NUM_SEQS
    assert MAX_NUM_SEQS == DEFAULT_MAX_NUM_SEQS


def test_without_the_serve_extra_it_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "fastapi", None)      # import fastapi -> ImportError
    assert main(["serve", str(tmp_path)]) == 2
    one_line_error(capsys, "fastapi", "pip install 'dsgraph[serve]'")


def test_no_model_and_a_taken_port_are_one_line(capsys, tmp_path):
    assert main(["serve", "--device", "cpu"]) == 2
    one_line_error(capsys, "give MODEL_DIR")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--random-weights", "--device", "cpu", "--port", str(port)]) == 2
    one_line_error(capsys, f"cannot listen on 127.0.0.1:{port}", "--port")


@pytest.mark.parametrize("argv, words", [(["--port", "0"], "--port"), (["--port", "70000"], "--port"),
                                         (["--max-num-seqs", "0"], "--max-num-seqs")])
def test_option_values_are_checked_at_the_option(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--random-weights", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err
