"""The one exception type of a mistake the user can fix, and how the CLI says it.

Every error a user can act on (a bad setting, input file, run directory, checkpoint or
endpoint) is a `UserError`; the CLI prints the first line of its message as
`keel: error: ...` and exits with status 2. Anything else is a bug and keeps its traceback.
`UserError` subclasses ValueError so that callers which caught ValueError before still do; the
CLI tests membership with isinstance, never `type(e) is ...`, so every subclass is covered.
"""

from __future__ import annotations

import errno
from pathlib import Path

USAGE = 2  # exit status of a user error (argparse's own)

# OSError numbers that say something about the user's machine or paths, not about Keel
USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
               errno.EEXIST, errno.ENAMETOOLONG, errno.EMFILE, errno.ENFILE, errno.EFBIG, errno.ENOTEMPTY, errno.ELOOP}


class UserError(ValueError):
    """A mistake the user can fix; the message is one line naming the file, key or URL."""


def user_message(exc: BaseException) -> str | None:
    """The one line `keel: error:` prints for `exc`, or None when `exc` is not a user error
    (a bug, whose traceback must be kept)."""
    if isinstance(exc, UserError):
        text = str(exc)
    elif isinstance(exc, OSError) and (exc.errno in USER_ERRNOS or exc.errno is None and isinstance(
            exc, (FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError))):
        text = os_error_message(exc)
    else:
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def os_error_message(exc: OSError, doing: str = "") -> str:
    """'<file>: <reason>' for an OSError (its own message when it has no file name); a full disk
    says what to do about it."""
    if exc.filename is None or exc.strerror is None:
        text = str(exc)
    else:
        text = f"{exc.filename}: {exc.strerror}"
    if doing:
        text = f"{doing}: {text}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        text += " (the disk is full: free space, then continue with `keel train --resume RUN_DIR` if a run was interrupted)"
    return text


def read_user_text(path: str | Path, what: str = "") -> str:
    """The text of a file the user gave, or a UserError naming it: Keel reads UTF-8, and a
    binary or Latin-1 file is said to be one (a missing file stays an OSError, said as one)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what + ' ' if what else ''}{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                        "Keel reads UTF-8 files") from None


class Aborted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM while the first one's step was being finished: stop at once.
    The CLI exits with 128 + `signum` (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Terminated(KeyboardInterrupt):
    """SIGTERM while no run's own handler (keel.run.Interrupted) is installed: loading the
    data or model, claiming the run directory, between a sweep's runs. It unwinds as Ctrl-C's
    KeyboardInterrupt does there, so what was made is removed; the CLI exits 128 + `signum` (143)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
