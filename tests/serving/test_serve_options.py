"""The server's own options (`--port`, `--host`, `--log-level`, `--max-waiting-requests`) are checked
before anything is built: a bad one is one line `error: ...` naming it and exit code 2, never a
server that listens elsewhere than it says or fails once the engine is up. Only the command line
runs here: `build_engine` is replaced, so no engine and no server start."""
from __future__ import annotations

import errno
import os
import socket

import pytest
from optional_deps import require_serving

require_serving()  # engine.serve imports the serving stack

from engine import serve


class Built(Exception):
    """Raised in place of building the engine: the options passed every check."""


@pytest.fixture
def no_engine(monkeypatch):
    def build(*args):
        raise Built
    monkeypatch.setattr(serve, "build_engine", build)


def one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        serve.main(["--model", "tiny-llama", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


PORT_TRIES = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD_OPTIONS = (  # (id, arguments, what the one line says)
    ("port-over-65535", ["--port", "99999"], "port=99999 is invalid: a TCP port in [1, 65535]"),
    ("port-negative", ["--port", "-1"], "port=-1 is invalid"),
    ("port-zero", ["--port", "0"], "port=0 is invalid"),
    ("host-empty", ["--host", ""], "host='' is invalid: an address to bind"),
    ("host-not-this-machine", ["--host", "192.0.2.1"], "host='192.0.2.1' is invalid: not an address of this machine"),
    ("log-level", ["--log-level", "nope"], "log_level='nope' is invalid: one of critical, error, warning"),
    ("max-waiting-negative", ["--max-waiting-requests", "-5"], "max_waiting_requests=-5 is invalid"),
    ("max-waiting-zero", ["--max-waiting-requests", "0"], "max_waiting_requests=0 is invalid"),
    ("seed-text", ["seed=x"], "seed='x' is invalid: an integer in [-2**63, 2**63 - 1]"),
    ("seed-float", ["--seed", "2.5"], "seed=2.5 is invalid"),
)


@pytest.mark.parametrize(("argv", "says"), [r[1:] for r in BAD_OPTIONS], ids=[r[0] for r in BAD_OPTIONS])
def test_a_bad_server_option_is_one_line_before_the_engine(argv, says, capsys, no_engine):
    assert says in one_line_error(argv, capsys)


def test_a_port_in_use_is_one_line_before_the_engine(capsys, no_engine):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = one_line_error(["--port", str(port)], capsys)
    assert f"port={port} is invalid: cannot listen at 127.0.0.1 port {port}" in err


@pytest.mark.parametrize("level", ["warning", "INFO"])
def test_good_options_reach_the_engine_and_leave_the_port_free(level, capsys, no_engine):
    """The check binds the address once and lets it go: the server can bind it after. The port is
    found free, let go and bound again (the server refuses port 0), so another process may take it
    in between (parallel runs): that try is repeated at another port; a port the check holds fails
    every try."""
    for _ in range(PORT_TRIES):
        port = free_port()
        try:
            serve.main(["--model", "tiny-llama", "--port", str(port), "--log-level", level,
                        "--max-waiting-requests", "8"])
        except Built:
            pass
        except SystemExit:
            if f"port {port} ({os.strerror(errno.EADDRINUSE)})" in capsys.readouterr().err:
                continue  # taken before the check bound it
            raise
        else:
            pytest.fail("the options did not reach the engine")
        with socket.socket() as again:
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                again.bind(("127.0.0.1", port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                raise
        return
    pytest.fail(f"no port stayed free from the check to binding it again in {PORT_TRIES} tries")
