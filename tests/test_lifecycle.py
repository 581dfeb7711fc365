"""The daemon as a process: socket files and modes, a live or stale socket, systemd
readiness and socket activation, SIGTERM with a turn running, a crash, peer uids."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from client import Wire
from core import Config
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import EVENT_TIMEOUT, RunningDaemon, serving

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 30.0


class DaemonProcess:
    """``python3 assistant.py`` as a child, with a notify socket to learn when it is ready."""

    def __init__(self, proc: asyncio.subprocess.Process, notify: socket.socket) -> None:
        self.proc = proc
        self.notify = notify

    @classmethod
    async def spawn(cls, tmp: Path, extra_env: dict[str, str] | None = None, **popen: object) -> DaemonProcess:
        notify_path = tmp / f"notify-{os.urandom(4).hex()}"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        notify.setblocking(False)
        env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), **(extra_env or {})}
        proc = await asyncio.create_subprocess_exec(
            *popen.pop("argv", [sys.executable, str(ROOT / "assistant.py")]),  # type: ignore[misc]
            env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, **popen,
        )
        return cls(proc, notify)

    async def notified(self, state: str = "READY=1") -> bool:
        """Wait for ``state`` from sd_notify; False if the process exited first."""
        loop = asyncio.get_running_loop()
        exited = asyncio.ensure_future(self.proc.wait())
        try:
            while True:
                recv = asyncio.ensure_future(loop.sock_recv(self.notify, 4096))
                done, _ = await asyncio.wait([recv, exited], timeout=READY_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
                if recv not in done:
                    recv.cancel()
                    return False
                if state in recv.result().decode():
                    return True
        finally:
            exited.cancel()

    async def stop(self, sig: int | None = signal.SIGTERM) -> tuple[int, str]:
        """Signal the daemon (``None``: it was already told) and wait for its exit status."""
        if sig is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)
        _out, err = await asyncio.wait_for(self.proc.communicate(), READY_TIMEOUT)
        self.notify.close()
        return self.proc.returncode or 0, err.decode()


@pytest_asyncio.fixture
async def spawned(config: Config, tmp_path: Path) -> AsyncIterator[list[DaemonProcess]]:
    procs: list[DaemonProcess] = []
    yield procs
    for proc in procs:
        await proc.stop(signal.SIGKILL)


async def exit_of(proc: DaemonProcess) -> tuple[int, str]:
    """Wait for a daemon that should refuse to start; its exit code and log."""
    code = await asyncio.wait_for(proc.proc.wait(), READY_TIMEOUT)
    _out, err = await proc.proc.communicate()
    proc.notify.close()
    return code, err.decode()


async def start(procs: list[DaemonProcess], tmp: Path, **kw: object) -> DaemonProcess:
    proc = await DaemonProcess.spawn(tmp, **kw)  # type: ignore[arg-type]
    procs.append(proc)
    assert await proc.notified(), (await proc.stop())[1]
    return proc


async def test_socket_is_private_and_removed_on_exit(spawned: list[DaemonProcess], config: Config, tmp_path: Path) -> None:
    proc = await start(spawned, tmp_path)
    path = config.socket_path
    assert stat.S_ISSOCK(path.lstat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    code, err = await proc.stop()
    assert code == 0, err
    assert not path.exists()
    assert "stopped" in err


async def test_the_daemon_runs_on_uvloop(spawned: list[DaemonProcess], config: Config, tmp_path: Path) -> None:
    """uvloop is a dependency on Linux: the daemon runs on it, and so does this suite."""
    proc = await start(spawned, tmp_path)
    code, err = await proc.stop()
    assert code == 0, err
    assert "loop uvloop)" in err
    assert type(asyncio.get_running_loop()).__module__.split(".")[0] == "uvloop"


async def test_the_daemon_serves_on_the_socket_given_with_socket(
    spawned: list[DaemonProcess], config: Config, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "b.sock"
    await start(spawned, tmp_path, argv=[sys.executable, str(ROOT / "assistant.py"), "--socket", str(elsewhere)])
    wire = await Wire.open(elsewhere, timeout=EVENT_TIMEOUT)
    assert (await wire.request({"type": "status"}))["socket"] == str(elsewhere)
    await wire.close()
    assert not config.socket_path.exists()


async def test_socket_directory_is_created_private(spawned: list[DaemonProcess], config: Config, tmp_path: Path) -> None:
    sock = Path(f"/tmp/asst-sub-{os.getpid()}") / "deeper" / "a.sock"
    try:
        await start(spawned, tmp_path, extra_env={"ASSISTANT_SOCKET": str(sock)})
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    finally:
        await spawned.pop().stop()
        sock.parent.rmdir()
        sock.parent.parent.rmdir()


async def test_stale_socket_is_replaced(spawned: list[DaemonProcess], config: Config, tmp_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(config.socket_path))
    stale.close()  # the file stays, nobody listens: what a crash leaves
    await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    assert (await wire.request({"type": "status"}))["type"] == "status"
    await wire.close()


async def test_second_daemon_refuses_to_start(spawned: list[DaemonProcess], config: Config, tmp_path: Path) -> None:
    await start(spawned, tmp_path)
    code, err = await exit_of(await DaemonProcess.spawn(tmp_path))
    assert code == 1
    assert "already serving" in err and "stopped" not in err, err  # it never served: nothing "stopped"
    # the first one is untouched
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    assert (await wire.request({"type": "status"}))["type"] == "status"
    await wire.close()


async def test_a_regular_file_at_the_socket_path_is_not_removed(spawned: list[DaemonProcess], config: Config, tmp_path: Path) -> None:
    config.socket_path.write_text("mine")
    code, err = await exit_of(await DaemonProcess.spawn(tmp_path))
    assert code == 1
    assert "is not a socket" in err
    assert config.socket_path.read_text() == "mine"


async def test_under_journald_a_traceback_is_one_line_of_its_record() -> None:
    code = (
        "import logging, assistant\n"
        "assistant.setup_logging(False)\n"
        "try:\n"
        "    {}['missing']\n"
        "except KeyError:\n"
        "    logging.getLogger('daemon.runner').exception('turn 2 of conversation 7 failed')\n"
    )
    for journald, lines in (("1", 1), ("", 4)):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, cwd=ROOT, env={**os.environ, "JOURNAL_STREAM": journald},
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        text = err.decode()
        assert "turn 2 of conversation 7 failed" in text and "KeyError: 'missing'" in text
        # journald makes each line an entry: under it, one line; on a terminal, the usual traceback
        assert len(text.splitlines()) == lines, text


async def test_sigterm_lets_a_turn_finish_briefly_then_stores_it(
    spawned: list[DaemonProcess], config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    router.script(Reply(chunks=["kept ", "on ", "shutdown"], hang=True))
    proc = await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    rid = await wire.send({"type": "ask", "text": "long story"})
    events = await wire.until_reply(rid, "kept on shutdown")
    cid = events[0]["conversation"]
    proc.proc.send_signal(signal.SIGTERM)
    # the turn cannot finish (the router hangs), so after the grace it is stopped and stored
    done = (await wire.until(rid))[-1]
    assert done["type"] == "done"
    assert done["finish_reason"] == "interrupted"
    await wire.close()
    code, err = await proc.stop(None)  # a second SIGTERM could land after the daemon let go of its handler
    assert code == 0, err
    proc2 = await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    turn = (await wire.request({"type": "open", "conversation": cid}))["turns"][0]
    assert turn["status"] == "interrupted"
    assert turn["reply"] == "kept on shutdown"
    await wire.close()
    await proc2.stop()


async def test_a_crash_keeps_the_question_and_checkpointed_reply(
    spawned: list[DaemonProcess], config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    router.script(Reply(chunks=["before ", "the crash"], hang=True))
    proc = await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    rid = await wire.send({"type": "ask", "text": "will you crash?"})
    cid = (await wire.until_reply(rid, "before the crash"))[0]["conversation"]
    # the streaming reply is checkpointed soon after its last delta; wait for that, then kill
    for _ in range(200):
        turn = (await wire.request({"type": "open", "conversation": cid}))["turns"][0]
        if turn["reply"] == "before the crash":
            break
        await asyncio.sleep(0.05)
    assert turn["status"] == "running"
    await proc.stop(signal.SIGKILL)
    await wire.close()
    await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    turn = (await wire.request({"type": "open", "conversation": cid}))["turns"][0]
    assert turn["text"] == "will you crash?"
    assert turn["status"] == "interrupted"
    assert turn["reply"] == "before the crash"
    # the next question replays the cut turn with the words the user saw, roles alternating
    await wire.ask("and now?", conversation=cid)
    sent = router.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[2]["content"] == "before the crash"
    await wire.close()


async def test_socket_activation_uses_the_passed_socket(spawned: list[DaemonProcess], config: Config, tmp_path: Path) -> None:
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    fd = listener.fileno()
    # what systemd does: the socket as fd 3, LISTEN_PID naming the daemon's own pid
    launcher = (
        "import os, sys\n"
        f"os.dup2({fd}, 3, inheritable=True)\n"
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1')\n"
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
    )
    argv = [sys.executable, "-c", launcher, str(ROOT / "assistant.py")]
    try:
        proc = await start(spawned, tmp_path, argv=argv, pass_fds=(fd,))
        listener.close()  # only the daemon holds it now
        assert not config.socket_path.exists()  # it bound nothing of its own
        wire = await Wire.open(path, timeout=EVENT_TIMEOUT)
        assert (await wire.request({"type": "status"}))["type"] == "status"
        await wire.close()
        code, err = await proc.stop()
        assert code == 0, err
        assert "using the socket passed by systemd" in err
        assert path.exists()  # systemd's file: not ours to remove
    finally:
        listener.close()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
async def test_connections_from_another_uid_are_refused(daemon: object, config: Config) -> None:
    # open the door wide, so only SO_PEERCRED stands between another user and the daemon
    os.chmod(config.socket_path.parent, 0o755)
    os.chmod(config.socket_path, 0o666)
    # it asks at once, as a client does: were the daemon to close with that line unread, the
    # connection would be reset and the refusal lost with it
    code = (
        "import asyncio, os, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "async def main():\n"
        "    reader, writer = await asyncio.open_unix_connection(sys.argv[1])\n"
        "    writer.write(b'{\"type\":\"status\",\"id\":1}\\n')\n"
        "    await asyncio.sleep(0.2)\n"
        "    print((await reader.read()).decode())\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, str(config.socket_path), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), READY_TIMEOUT)
    # the daemon says why, then hangs up: read() above returned at EOF
    assert out.decode().strip() == (
        '{"type":"error","code":"forbidden","message":"this daemon serves only its own user"}'
    )
    # our own client, run by that user, says so too (not "the daemon closed the connection"),
    # whether its line reached the daemon before the refusal or after (a few runs of each)
    # imported first, by root: another user may not enter root's home, where Python is
    as_nobody = (
        "import os, sys, assistant, client.turn, client.render, client.terminal\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "sys.exit(assistant.main(sys.argv[1:]))\n"
    )
    async def run(args: tuple[str, ...]) -> tuple[tuple[str, ...], int | None, bytes, bytes]:
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", as_nobody, *args, cwd=ROOT,
            env={**os.environ, "ASSISTANT_SOCKET": str(config.socket_path), "HOME": "/nonexistent"},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(client.communicate(), READY_TIMEOUT)
        return args, client.returncode, out, err

    # the nine at once: each is a client's start, and none waits for another
    for args, code, out, err in await asyncio.gather(*map(run, [("ask", "hello"), ("ask", "-c", "hello"),
                                                               ("status",)] * 3)):
        assert code == 1 and out == b"", (args, err)
        assert "this daemon serves only its own user" in err.decode(), (args, err)


async def test_sigterm_lets_a_short_turn_finish(
    spawned: list[DaemonProcess], config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    # five chunks 50 ms apart: done within the 0.5 s grace
    router.script(Reply(chunks=["all ", "of ", "it ", "gets ", "through"], delay=0.05))
    proc = await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    rid = await wire.send({"type": "ask", "text": "quick one"})
    await wire.until(rid, ("delta",))
    proc.proc.send_signal(signal.SIGTERM)
    done = (await wire.until(rid))[-1]
    assert done["type"] == "done" and done["finish_reason"] == "stop"
    assert done["text"] == "all of it gets through"
    await wire.close()
    code, err = await proc.stop(None)
    assert code == 0, err


async def test_a_damaged_database_stops_the_start_with_one_clear_line(
    spawned: list[DaemonProcess], config: Config, tmp_path: Path
) -> None:
    config.data_dir.mkdir(parents=True, exist_ok=True)
    config.db_path.write_bytes(b"this is not a database at all " * 200)
    code, err = await exit_of(await DaemonProcess.spawn(tmp_path))
    assert code == 78  # systemd's RestartPreventExitStatus: no restart loop
    assert "Traceback" not in err
    [line] = [ln for ln in err.splitlines() if "cannot start" in ln]
    assert str(config.db_path) in line and "move it aside" in line


async def test_an_unwritable_data_folder_says_so(spawned: list[DaemonProcess], config: Config, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        parent = tmp_path / "locked"
        parent.mkdir()
        parent.chmod(0o500)
        # root writes anywhere: a file in the way of the folder makes the same failure
        blocker = tmp_path / "blocker"
        blocker.write_text("")
        env = {"ASSISTANT_DATA_DIR": str(blocker / "data")}
    else:
        parent = tmp_path / "locked"
        parent.mkdir(mode=0o500)
        env = {"ASSISTANT_DATA_DIR": str(parent / "data")}
    code, err = await exit_of(await DaemonProcess.spawn(tmp_path, extra_env=env))
    assert code == 78 and "Traceback" not in err
    assert "cannot create the data folder" in err and "ASSISTANT_DATA_DIR" in err


async def test_a_database_damaged_inside_is_served_with_a_warning(
    spawned: list[DaemonProcess], config: Config, tmp_path: Path
) -> None:
    config.data_dir.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(config.db_path)
    conn.execute("CREATE TABLE filler (x TEXT)")
    conn.executemany("INSERT INTO filler VALUES (?)", [("y" * 500,) for _ in range(400)])
    conn.commit()
    conn.close()
    data = bytearray(config.db_path.read_bytes())
    page = 4096
    data[page * 3 + 8 : page * 3 + 64] = b"\xff" * 56  # a b-tree page's header, past the file header
    config.db_path.write_bytes(bytes(data))
    proc = await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    assert (await wire.request({"type": "status"}))["type"] == "status"
    await wire.close()
    _code, err = await proc.stop()
    assert "is damaged" in err and ".recover" in err


@pytest.mark.parametrize("env, words", [
    ({"ASSISTANT_CONFIG": "/nonexistent/assistant.toml"}, "ASSISTANT_CONFIG names /nonexistent/assistant.toml"),
    ({"ASSISTANT_SOCKET": "/tmp/" + "s" * 120 + "/a.sock"}, "over the 107 a Unix socket allows"),
])
async def test_a_setup_error_is_one_line_and_exit_78(tmp_path: Path, env: dict[str, str], words: str) -> None:
    code, err = await exit_of(await DaemonProcess.spawn(tmp_path, extra_env=env))
    assert code == 78 and "Traceback" not in err
    [line] = [ln for ln in err.splitlines() if "ERROR" in ln]
    assert words in line


async def test_an_unknown_variable_is_warned_about_and_the_daemon_starts(
    spawned: list[DaemonProcess], tmp_path: Path
) -> None:
    proc = await start(spawned, tmp_path, extra_env={"ASSISTANT_ROUTERURL": "http://127.0.0.1:1/v1"})
    code, err = await proc.stop()
    assert code == 0
    assert "ASSISTANT_ROUTERURL is not a setting and is ignored; did you mean ASSISTANT_ROUTER_URL?" in err


async def test_the_mode_of_a_folder_the_daemon_did_not_create_is_left_alone(
    spawned: list[DaemonProcess], config: Config, tmp_path: Path
) -> None:
    home = Path(f"/tmp/asst-home-{os.getpid()}")
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    try:
        await start(spawned, tmp_path, extra_env={"ASSISTANT_SOCKET": str(home / "a.sock")})
        assert stat.S_IMODE(home.stat().st_mode) == 0o755  # ASSISTANT_SOCKET=~/a.sock must not close ~
        assert stat.S_IMODE((home / "a.sock").stat().st_mode) == 0o600
    finally:
        await spawned.pop().stop()
        home.rmdir()


async def test_a_daemon_killed_mid_reply_is_named_with_the_turn_by_the_client(
    spawned: list[DaemonProcess], router: FakeRouter, tmp_path: Path
) -> None:
    router.script(Reply(chunks=["half of it"], hang=True))
    proc = await start(spawned, tmp_path)
    client = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "assistant.py"), "ask", "tell me everything", cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert client.stdout is not None
    assert await asyncio.wait_for(client.stdout.readexactly(10), EVENT_TIMEOUT) == b"half of it"
    await proc.stop(signal.SIGKILL)
    _out, err = await asyncio.wait_for(client.communicate(), EVENT_TIMEOUT)
    assert client.returncode == 3
    assert "it was answering conversation 1, turn 1: the question is kept" in err.decode(), err.decode()
    assert "assistant open 1" in err.decode()


async def test_a_history_damaged_while_running_is_named_with_its_recovery(
    daemon: RunningDaemon, router: FakeRouter
) -> None:
    """history.db overwritten under a running daemon was `internal` ("a bug") on open, search
    and ask: it is `history_damaged`, naming the file and the way to recover it."""
    wire = await daemon.connect()
    for n in range(3):
        await wire.ask(f"question {n} " + "filler " * 2000)
    db = daemon.config.db_path
    other = sqlite3.connect(db)  # the pages into the file, where the stray write lands
    other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    other.close()
    with db.open("r+b") as damaged:  # every page past the header overwritten, as a stray write would
        size = damaged.seek(0, os.SEEK_END)
        damaged.seek(4096)
        damaged.write(b"\xa5" * (size - 4096))
    refusals = [await wire.request({"type": "search", "query": "filler"}),
                await wire.request({"type": "open", "conversation": 2}),
                (await wire.ask("still there?", conversation=1))[-1]]
    for refused in refusals:
        assert refused["type"] == "error" and refused["code"] == "history_damaged", refused
        assert str(db) in refused["message"] and ".recover" in refused["message"]
    assert (await wire.request({"type": "status"}))["type"] == "status"  # the daemon goes on
    await wire.close()


async def test_a_long_migration_asks_systemd_for_more_time(
    config: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd's 90 s start timeout killed a multi-million-turn migration, in a loop: while the
    history opens, the daemon asks for more time (EXTEND_TIMEOUT_USEC), then says READY=1."""
    from daemon import notify, server
    from history import AsyncHistory

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setattr(notify, "EXTEND_EVERY", 0.01)
    opened = asyncio.Event()
    real_open = AsyncHistory.open

    async def migrating(path: Path) -> AsyncHistory:
        got: list[bytes] = []
        async with asyncio.timeout(30):  # a hang guard only
            while not any(b"EXTEND_TIMEOUT_USEC" in g for g in got):  # a migration that lasts until asked
                got.append(await asyncio.get_running_loop().sock_recv(listener, 4096))
        opened.set()
        return await real_open(path)

    monkeypatch.setattr(server.AsyncHistory, "open", migrating)
    try:
        async with serving(config) as (_daemon, wire):
            assert opened.is_set() and (await wire.request({"type": "status"}))["type"] == "status"
        states = []
        while True:
            try:
                states.append(listener.recv(4096).decode())
            except BlockingIOError:
                break
        ready = next(i for i, s in enumerate(states) if s.startswith("READY=1"))
        assert not any("EXTEND" in s for s in states[ready:]), states
    finally:
        listener.close()
