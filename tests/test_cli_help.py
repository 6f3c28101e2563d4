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


def test_progress_shows_a_time_left_only_once_a_rate_is_known():
    """The first units carry the start-up (loading, compiling): the estimate starts from
    the units after them, at the rate since."""
    import io

    from flashloop_backend.host.progress import ProgressBar

    bar = ProgressBar("work", 10, "steps", stream=io.StringIO())
    assert bar.seconds_left(0, now=bar.start + 60) is None
    assert bar.seconds_left(1, now=bar.start + 60) is None  # 60 s of start-up, one step
    assert bar.seconds_left(1, now=bar.start + 61) is None  # no step since: no rate yet
    assert bar.seconds_left(3, now=bar.start + 62) == 7  # 2 steps in 2 s, 7 left
    assert bar.seconds_left(10, now=bar.start + 69) is None  # done
    assert "left" not in ProgressBar("w", 10, "s", stream=io.StringIO()).line(1)


def test_info_says_why_a_backend_or_provider_is_unavailable_here(capsys):
    """A backend or kernel provider this machine cannot use is listed with the reasons,
    never with an empty capability list."""
    import importlib.util

    from flashloop_backend.cli.main import main

    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if line.endswith(": -")]
    if importlib.util.find_spec("flashinfer") is None:
        flashinfer = [line for line in lines if line.strip().startswith("flashinfer ")]
        assert len(flashinfer) == 2  # the backend and the kernel provider
        for line in flashinfer:
            assert "unavailable here:" in line and "'flashinfer' is not installed" in line


def test_the_demo_footnote_judges_quality_against_the_all_on_budget():
    """The main job's quality footnote says whether its own measurement is inside the
    all-on budget, naming each miss, instead of a fixed sentence about one model."""
    from flashloop_backend.cli.showcase import quality_note

    inside = quality_note(0.3, (-0.2, 0.9), 0.99)
    assert "here it is within the all-on quality budget" in inside
    outside = quality_note(7.58, (1.6, 48.1), 0.967)
    assert "outside the all-on quality budget on this model" in outside
    assert "Δ bits/byte +7.58% > +1.0%" in outside and "top-1 agreement 96.70% < 98%" in outside
    assert "interval's upper end +48.10% > +1.5%" in outside
