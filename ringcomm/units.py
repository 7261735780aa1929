"""Byte sizes as people write them: ``parse_size("4MiB") == 4 << 20``, ``human(4 << 20) == "4 MiB"``.

K, M and G are powers of 1024, with or without a trailing ``B``/``iB``.
"""
import argparse
import re


class SizeError(ValueError, argparse.ArgumentTypeError):
    """Not a size; argparse shows the message as it is (an ArgumentTypeError)."""


def parse_size(text):
    """'4096', '4K', '4KiB', '16M', '1G' -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise SizeError(f"not a size in bytes: {text!r} (try 4096, 256KiB, 4MiB)")
    return int(match.group(1)) * 1024 ** " KMG".index(match.group(2).upper() or " ")


def human(nbytes):
    """The largest binary unit that divides ``nbytes`` exactly: 4 MiB, 1536 KiB, 100 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
