"""Every command and option of the CLI says what it does in plain text: a help string on
each, no reStructuredText markup (double backquotes, :mod: roles) in any of them, and the
bench modes described."""

import argparse
import re

import pytest

from flashloop_backend.cli.main import build_parser

MARKUP = re.compile(r"``|:(mod|class|func|meth|attr):")


def _commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_the_top_level_help_is_plain_text():
    parser, _ = _commands()
    text = parser.format_help()
    assert not MARKUP.search(text), text


@pytest.mark.parametrize("command", sorted(_commands()[1]))
def test_every_option_of_every_command_has_plain_help(command):
    parser = _commands()[1][command]
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert not missing, f"{command}: options without help: {missing}"
    text = parser.format_help()
    assert not MARKUP.search(text), text


def test_bench_help_describes_every_mode():
    text = _commands()[1]["bench"].format_help()
    for mode in ("kernel", "e2e", "sparse", "prefill", "packed", "serving"):
        assert re.search(rf"^\s+{mode}\s+\S", text, re.M), f"bench mode {mode} is not described"
