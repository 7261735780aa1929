"""Byte sizes as written on command lines, both ways."""
import argparse

import pytest

from ringcomm.units import SizeError, human, parse_size


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("4K", 4096), ("4kib", 4096), (" 16MiB ", 16 << 20), ("1G", 1 << 30), ("3B", 3)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4X", "1.5M", "-4K", "K"])
def test_bad_sizes_say_what_was_wrong(text):
    with pytest.raises(SizeError, match="not a size"):
        parse_size(text)


def test_argparse_shows_the_message():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=parse_size)
    assert parser.parse_args(["--size", "2M"]).size == 2 << 20
    with pytest.raises(SystemExit):
        parser.parse_args(["--size", "2X"])


@pytest.mark.parametrize("nbytes, text", [(4 << 20, "4 MiB"), (1536 << 10, "1536 KiB"), (100, "100 B"),
                                          (1 << 30, "1 GiB"), (0, "0 B")])
def test_human(nbytes, text):
    assert human(nbytes) == text
    assert nbytes == 0 or parse_size(text.replace(" ", "")) == nbytes
