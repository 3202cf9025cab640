"""Command-line value types shared by the examples: refused at parse time with a
usage error, before any agent starts work (not a traceback at the end of a run)."""
import argparse
import math
import os


def positive_float(text):
    """A finite number > 0 (a step size)."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def positive_int(text):
    """A whole number >= 1 (a count: steps, samples, a batch size)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def non_negative_float(text):
    """A finite number >= 0 (a time scale)."""
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text!r}")
    return value


def _float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def output_file(path):
    """A file the run can write at its end: its folder exists and is writable, and it
    is not a folder itself."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist (create it first)")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder!r} is not writable")
    return path
