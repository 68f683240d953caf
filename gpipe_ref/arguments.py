"""Command-line argument types: each converts and checks one value, and a bad one ends the command naming it."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from .checks import non_negative, positive, positive_int, probe_writable, write_atomically

__all__ = ["COST", "COUNT", "MAX_SIMULATED", "PROG", "RATE", "CommandLineParser", "ResultsFile", "checked", "folder",
           "output_file", "writable_folder"]

PROG = "python -m gpipe_ref"


class CommandLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``PROG simulate: error: argument --stages: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def checked(check: Callable[[str, Any], Any], convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=``: the text converted by ``convert``, then held to a :mod:`gpipe_ref.checks` rule.

    A refused value's message is the rule's own, without the name argparse already puts in
    front (``argument --stages: must be an integer >= 1, got 0``)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = text  # the rule refuses it and quotes the text
        try:
            return check("", value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).strip()) from None

    parse.__name__ = check.__name__
    return parse


COUNT = checked(positive_int, int)  # an integer >= 1
COST = checked(non_negative, float)  # a number >= 0
RATE = checked(positive, float)  # a number > 0: a learning rate

# The largest stages x micro-batches x stages per device that `simulate` takes: 2**17 simulates with its
# figures in about 1-4 s on a 2-core CPU (7-10 us per action; 2 actions per stage and micro-batch, 3 for
# zero_bubble_h1), writing --trace takes about as long again.
MAX_SIMULATED = 2 ** 17


def output_file(*, makes_folders: bool = False) -> Callable[[str], str]:
    """An argparse ``type=`` for a file the command writes, refused at once if it cannot be written.

    With ``makes_folders`` the command creates missing folders, so only the nearest folder that
    exists must be a writable folder. Under torchrun only rank 0 writes, so other ranks skip the check."""
    def writable(text: str) -> str:
        if os.environ.get("RANK", "0") != "0":
            return text
        path = Path(text)
        try:
            if makes_folders and not path.parent.exists():
                writable_folder(path.parent)
            else:
                probe_writable(path)
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror}") from None
        return text

    return writable


def writable_folder(folder: Path) -> None:
    """OSError unless ``folder`` is, or can be made inside, a writable folder."""
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
    if not os.access(existing, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def folder(text: str) -> str:
    """An argparse ``type=`` for a folder the command reads: it must exist."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such folder {text!r}" if not Path(text).exists()
                                         else f"{text!r} is not a folder")
    return text


class ResultsFile:
    """The ``--json`` file of ``args``, rewritten as results come in, so that a long run stopped half
    way keeps what it finished. When the last write fails all the same (a disk filled up, a folder
    removed during the run), the results are printed to stdout instead of being lost, and
    :meth:`finish` returns 1."""

    def __init__(self, args: argparse.Namespace, *, makes_folders: bool = False) -> None:
        self.prog, self.path, self.makes_folders = f"{PROG} {args.command}", args.json, makes_folders
        self.failure: str | None = None  # why the last write failed

    def save(self, results: Any) -> bool:
        """Write ``results`` as JSON; a failure is said once on stderr, and the run goes on."""
        if self.path is None:
            return True
        try:
            if self.makes_folders:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(results, indent=2, default=str) + "\n")
        except OSError as exc:
            if self.failure is None:
                print(f"{self.prog}: warning: --json: cannot write {self.path!r}: {exc.strerror or exc}; "
                      f"trying again at the end", file=sys.stderr, flush=True)
            self.failure = exc.strerror or str(exc)
            return False
        self.failure = None
        return True

    def finish(self, results: Any) -> int:
        """The last write: 0 if it worked, else print ``results`` to stdout, say why on stderr and return 1."""
        if self.path is None:
            return 0
        if self.save(results):
            print(f"wrote {self.path}")
            return 0
        print(json.dumps(results, indent=2, default=str))
        print(f"{self.prog}: error: --json: could not write {self.path!r}: {self.failure}; "
              f"the results are printed above instead", file=sys.stderr)
        return 1
