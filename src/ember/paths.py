"""Where Ember keeps what it builds from a checkpoint (quantized weights, compiled decode steps)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

CACHE_DIR_ENV = "EMBER_CACHE_DIR"


def cache_root() -> Path:
    """`$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`, else `~/.cache/ember`; each kind of entry has a subfolder."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"
    return Path(root).expanduser()


# A writer's temporary: NAME.HOST-PID-RANDOM.tmp, then perhaps more suffixes (HOST: a hash of the host's name).
_TEMPORARY = re.compile(r"\.([0-9a-f]{8})-(\d+)-[0-9a-f]+\.tmp(\.|$)")


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temporary(path: Path, suffix: str = "") -> Path:
    """The name a writer gives `path` until it renames it into place (atomic: no reader sees half a file): beside
    it, with this host and process, so that a later writer can tell it from a live one's (`remove_stale`)."""
    return path.with_name(f"{path.name}.{_host()}-{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}")


def write_atomically(path: Path, write: Callable[[Path], object], suffix: str = "") -> None:
    """`write(tmp)` to a temporary beside `path` (`temporary(path, suffix)`), then renamed to `path`; the folder is
    made if need be and dead writers' temporaries in it removed first. Whatever `write` raises propagates, and
    its temporary is gone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path.parent)
    tmp = temporary(path, suffix)
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale(folder: Path) -> None:
    """Removes the temporaries in `folder` whose writers are gone: a process killed mid-write (SIGKILL, the OOM
    killer, a closed terminal) leaves its temporary, which can be a model's worth of quantized weights. Only
    this host's: a cache folder shared with other machines or containers may hold their live writers' files,
    whose process ids mean nothing here."""
    if os.name != "posix":  # os.kill(pid, 0) is a liveness test on POSIX only (Windows would end the process)
        return
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return
    host = _host()
    for name in names:
        found = _TEMPORARY.search(name)
        if found is None or found.group(1) != host or _alive(int(found.group(2))):
            continue
        with contextlib.suppress(OSError):
            (folder / name).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, say: alive
        return True
    return True
