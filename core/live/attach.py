"""Watching a run from another terminal: the engine serves its snapshots and events over a Unix
socket in the run directory; `draftgen attach RUN_DIR` reads them and renders the same panels.

The stream is one JSON object per line (newline-delimited), server to client only:

    {"type": "hello", "protocol": 1, "pid": 1234, "run_dir": "/runs/k25"}
    {"type": "event", "data": {"ts": ..., "level": "info", "kind": "...", "message": "..."}}
    {"type": "snapshot", "data": {...RunSnapshot as JSON, see core/live/snapshot.py...}}
    {"type": "bye", "reason": "run ended"}

Security: the socket is created owner-only (0600) and the server never interprets a byte a client
sends (it reads and discards them), so a viewer cannot change the run. Each client has its own
bounded hub subscription: a client that stops reading loses old snapshots, and is dropped when
its socket stays full for `stall_timeout_s`; the engine is never made to wait. At most
`MAX_CLIENTS` viewers are served at once; one more is closed as soon as it is accepted. A refusal,
or an accept that fails (EMFILE: out of file descriptors), is said at most once per
`NOTE_INTERVAL_S` with a count, and a failed accept waits `ACCEPT_RETRY_S` before the next: the
server accepts in its own loop, not asyncio's (which, out of descriptors, logs in a tight loop).

Here: the server, and what both sides need to find the socket; the viewer's side (`draftgen attach`,
reading this stream back into snapshots and events): core/live/attach_viewer.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from draftgen.core.errors import DraftgenError
from draftgen.core.live.events import Event
from draftgen.core.live.hub import Hub, Subscription
from draftgen.core.live.stage_payloads import Attach
from draftgen.core.rundir import RunDir
from draftgen.core.safe_text import visible

PROTOCOL = 1
MAX_CLIENTS = 128       # viewers served at once (a hundred attached at once must all get in)
NOTE_INTERVAL_S = 10.0  # a refusal or accept failure is said at most this often, with a count
ACCEPT_RETRY_S = 1.0    # after a failed accept (out of descriptors): wait, never spin
MAX_LINE = 16 << 20     # one snapshot line; far above any real one (a few KB)
SUN_PATH_MAX = 100      # sockaddr_un holds ~108 bytes; longer paths go through /proc/self/fd


class AttachError(DraftgenError):
    pass


@contextlib.contextmanager
def short_path(path: Path) -> Iterator[str]:
    """A name for `path` that fits in a sockaddr_un: itself, or /proc/self/fd/N/NAME through an open
    descriptor of its directory (run directories can be deep)."""
    if len(os.fsencode(str(path))) <= SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        short = f"/proc/self/fd/{fd}/{path.name}"
        if len(short) > SUN_PATH_MAX:
            raise AttachError(f"{path}: the socket name is too long for a Unix socket")
        yield short
    finally:
        os.close(fd)


def _connect_blocking(path: Path) -> bool:
    """True when something is listening on `path` (a live run), False for a stale file."""
    with short_path(path) as name, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(name)
        except (TimeoutError, ConnectionRefusedError, FileNotFoundError):
            return False
        return True


DENIED = ("permission denied (the run directory and its socket are owner-only: attach as the user who started "
          "the run)")


def run_directory(run_dir: Path) -> None:
    """AttachError unless `run_dir` is a folder this user may look at."""
    try:
        st = os.stat(run_dir)
    except PermissionError:
        raise AttachError(f"cannot attach to {run_dir}: {DENIED}") from None
    except OSError:
        raise AttachError(f"cannot attach: {run_dir} is not a run directory (no such directory)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise AttachError(f"cannot attach: {run_dir} is not a run directory (not a folder)")


def check_access(run_dir: Path) -> None:
    """AttachError when this user may not attach to the run in `run_dir`: the directory cannot be looked into,
    or its socket refuses the connection for lack of permission (EACCES); a missing socket or a run not
    serving yet is no error (the viewer waits for it)."""
    run_directory(run_dir)
    path = RunDir(run_dir).socket
    try:
        _connect_blocking(path)
    except PermissionError:
        raise AttachError(f"cannot attach to {path}: {DENIED}") from None
    except OSError:
        pass  # not a socket yet, or another failure the viewer's loop meets and says again


def _encode(kind: str, payload: bytes) -> bytes:
    return b'{"type":"' + kind.encode() + b'","data":' + payload + b"}\n"


class AttachServer:
    """Serves a hub's snapshots and events to any number of read-only viewers."""

    def __init__(self, hub: Hub, socket_path: Path, *, client_queue: int = 32,
                 stall_timeout_s: float = 10.0, on_warning: Callable[[str], None] | None = None,
                 max_clients: int | None = None) -> None:
        self.hub = hub
        self.path = Path(socket_path)
        self.client_queue = client_queue
        self.stall_timeout_s = stall_timeout_s
        self.max_clients = MAX_CLIENTS if max_clients is None else max_clients
        self.dropped_clients = 0     # clients cut off for not reading
        self.refused_clients = 0     # clients closed at once: `max_clients` were being served
        self.accept_failures = 0     # accepts the system refused (out of descriptors, memory)
        self._on_warning = on_warning or self._warn_on_hub
        self._notes: dict[str, tuple[float, int]] = {}   # kind -> (when last said, how many since)
        self._listener: socket.socket | None = None
        self._accepter: asyncio.Task[None] | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._writers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._inode: int | None = None
        self._closing = False
        self._reason = "run ended"
        # Every client is sent the same snapshot objects: encode each once, not once per client.
        self._encoded: tuple[object, bytes] | None = None

    @property
    def clients(self) -> int:
        return len(self._clients)

    async def start(self) -> None:
        self._listener = self._bind()
        self._accepter = asyncio.create_task(self._accept_loop(self._listener))

    def _warn_on_hub(self, message: str) -> None:
        self.hub.publish_event(Event.of(Attach(detail=message)))

    def _note(self, kind: str, message: str) -> None:
        """Say `message` unless this kind was said less than NOTE_INTERVAL_S ago (then count it)."""
        now = time.monotonic()
        last, count = self._notes.get(kind, (-math.inf, 0))
        if now - last < NOTE_INTERVAL_S:
            self._notes[kind] = (last, count + 1)
            return
        self._notes[kind] = (now, 0)
        more = f" ({count} more since the last such message)" if count else ""
        self._on_warning(message + more)

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: the viewer stays queued; wait for descriptors to free up.
                self.accept_failures += 1
                self._note("accept", f"attach: cannot accept a viewer ({e.strerror or e}); retrying every "
                                     f"{ACCEPT_RETRY_S:g} s")
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            if len(self._clients) >= self.max_clients:
                conn.close()
                self.refused_clients += 1
                self._note("refused", f"attach: viewer refused, {self.max_clients} already attached (the most "
                                      f"served at once)")
                continue
            try:
                reader, writer = await asyncio.open_unix_connection(sock=conn, limit=MAX_LINE)
            except OSError:
                conn.close()
                continue
            task = asyncio.create_task(self._serve(reader, writer))
            # Counted from now, not when it first runs, so a burst of connections cannot overshoot the cap.
            self._clients.add(task)
            task.add_done_callback(self._clients.discard)

    def _bind(self) -> socket.socket:
        parent = self.path.parent
        if not parent.is_dir():
            raise AttachError(f"cannot serve attach socket {self.path}: {parent} is not a directory")
        if self.path.is_symlink() or (self.path.exists() and not stat.S_ISSOCK(self.path.lstat().st_mode)):
            raise AttachError(f"cannot serve attach socket {self.path}: a file that is not a socket is in the"
                              " way; move it and start again")
        if self.path.exists():
            if _connect_blocking(self.path):
                raise AttachError(f"another draftgen process is serving {self.path}: a run is already live in"
                                  f" {parent}")
            self.path.unlink()  # left by a run that crashed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # born 0600: no window in which others could connect
        try:
            with short_path(self.path) as name:
                sock.bind(name)
        except OSError as e:
            sock.close()
            raise AttachError(f"cannot create attach socket {self.path}: {e.strerror or e}") from e
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._inode = self.path.lstat().st_ino
        sock.listen(socket.SOMAXCONN)  # a hundred viewers connecting at once must all get in
        sock.setblocking(False)
        return sock

    def _line(self, item: tuple[str, Any]) -> bytes:
        kind, obj = item
        if kind == "snapshot":
            cached = self._encoded
            if cached is not None and cached[0] is obj:
                return cached[1]
            line = _encode("snapshot", obj.to_json())
            self._encoded = (obj, line)
            return line
        return _encode(kind, obj.to_json())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closing:
            writer.close()
            return
        self._writers[task] = writer
        sub = self.hub.subscribe(maxsize=self.client_queue)
        discard = asyncio.create_task(self._discard(reader))
        try:
            hello = {"type": "hello", "protocol": PROTOCOL, "pid": os.getpid(),
                     "run_dir": visible(str(self.path.parent))}
            writer.write(orjson.dumps(hello) + b"\n")
            await self._pump(sub, writer, discard)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass  # cancelled: the server is closing and says goodbye below
        finally:
            sub.close()
            discard.cancel()
            self._clients.discard(task)
            self._writers.pop(task, None)
            if self._closing and not writer.is_closing():
                with contextlib.suppress(Exception):
                    writer.write(orjson.dumps({"type": "bye", "reason": self._reason}) + b"\n")
                    async with asyncio.timeout(1.0):
                        await writer.drain()
            writer.close()

    async def _pump(self, sub: Subscription, writer: asyncio.StreamWriter, discard: asyncio.Task[None]) -> None:
        while not discard.done():
            getter = asyncio.ensure_future(sub.get())
            # A viewer that hangs up is noticed at once, not at the next snapshot.
            try:
                await asyncio.wait((getter, discard), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()
            if not getter.done() or getter.cancelled():
                return
            writer.write(self._line(getter.result()))
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel (the server's
                # close) that arrives as the drain completes, and the pump went on to the next snapshot.
                async with asyncio.timeout(self.stall_timeout_s):
                    await writer.drain()
            except TimeoutError:
                # Its socket stayed full: cut it off rather than hold its backlog.
                self.dropped_clients += 1
                writer.transport.abort()
                return

    @staticmethod
    async def _discard(reader: asyncio.StreamReader) -> None:
        """Read and throw away whatever a client sends: the stream is one-way by design."""
        with contextlib.suppress(ConnectionError, OSError):
            while await reader.read(65536):
                pass

    async def close(self, reason: str = "run ended") -> None:
        """Say goodbye to every viewer, stop serving and remove the socket file."""
        if self._closing:
            return
        self._closing = True
        self._reason = reason
        if self._accepter is not None:
            self._accepter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepter
        if self._listener is not None:
            self._listener.close()
        for task in tuple(self._clients):
            task.cancel()
        if self._clients:
            _, stuck = await asyncio.wait(tuple(self._clients), timeout=2.0)
            # Viewers whose socket stays full (they never read) can hold a goodbye forever: cut them.
            for task in stuck:
                writer = self._writers.get(task)
                if writer is not None:
                    writer.transport.abort()
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=2.0)
        self._remove_socket()

    def _remove_socket(self) -> None:
        # Only our own socket: a restarted run may already have put its own in place.
        with contextlib.suppress(FileNotFoundError):
            if self._inode is not None and self.path.lstat().st_ino == self._inode:
                self.path.unlink()

    async def __aenter__(self) -> AttachServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
