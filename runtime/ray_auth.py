"""Joining a token-protected Ray cluster: tell a refused token from a head that is still starting.

``ray.init(address=...)`` reports a token the head refuses as a plain ``ConnectionError`` ("Failed
to connect to Ray cluster"), after retrying for about 20 s; the reason (``InvalidAuthToken``) only
reaches stderr. A join loop that retries connection errors until its timeout would then wait the
whole ``cluster.ray.join_timeout_s`` for a head that will never accept it (seen when an earlier
run's Ray, started with another token, still listened on the port). :func:`token_refused` asks the
head directly: when its port accepts connections, one GCS call with this process's token answers
at once whether the head takes the token.

:func:`token_source` says where this process's token comes from, in the order Ray reads it
(``RAY_AUTH_TOKEN``, then the file ``RAY_AUTH_TOKEN_PATH``, then ``~/.ray/auth_token``), without
ever reading the token into a message. Ray is imported inside the functions.

Ray 2.60 turns token auth on by itself when ``RAY_AUTH_MODE`` is unset and ``~/.ray/auth_token``
exists (any earlier local ``ray.init`` writes that file): ``ray start --head`` then starts a
token-protected head. A process joining it sends that file's token to an explicit address
(``RAY_ADDRESS`` included) only with ``RAY_AUTH_MODE=token``; :func:`token_source` says so.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

#: Seconds the GCS call of :func:`token_refused` may take once the head's port accepts connections.
ASK_TIMEOUT_S = 5


def join_address(address: str, env: Mapping[str, str] | None = None) -> str | None:
    """The ``host:port`` a join with ``address`` dials (``auto``: ``RAY_ADDRESS``), or ``None``
    when it names no port (then nothing can be asked before ``ray.init``)."""
    env = os.environ if env is None else env
    if address == "auto":
        address = env.get("RAY_ADDRESS", "")
    address = address.removeprefix("ray://")
    host, sep, port = address.rpartition(":")
    return address if sep and host and port.isdigit() else None


def token_source(env: Mapping[str, str] | None = None) -> str:
    """Where this process's Ray token comes from (never the token), for an error message."""
    env = os.environ if env is None else env
    mode = env.get("RAY_AUTH_MODE", "")
    default = Path(env.get("HOME") or Path.home()) / ".ray" / "auth_token"
    if not mode and default.exists():
        return (f"no token: RAY_AUTH_MODE is not set here. A Ray head started where {default} exists turns token "
                "auth on by itself, but a process joining it by address sends that token only with "
                "RAY_AUTH_MODE=token: set RAY_AUTH_MODE=token here (and RAY_AUTH_TOKEN_PATH if the head used "
                "another file), or start the head with RAY_AUTH_MODE=disabled")
    if mode != "token":
        return (f"no token: RAY_AUTH_MODE is {mode!r} here, not 'token', so this process sends none" if mode
                else "no token: RAY_AUTH_MODE is not set here (Ray sends a token only with RAY_AUTH_MODE=token)")
    if env.get("RAY_AUTH_TOKEN"):
        return "the RAY_AUTH_TOKEN environment variable"
    if env.get("RAY_AUTH_TOKEN_PATH"):
        return (
            f"the file {env['RAY_AUTH_TOKEN_PATH']} (RAY_AUTH_TOKEN_PATH){_file_note(Path(env['RAY_AUTH_TOKEN_PATH']))}"
        )
    return (f"Ray's default token file {default} (RAY_AUTH_TOKEN and RAY_AUTH_TOKEN_PATH are not set)"
            f"{_file_note(default)}")


def _file_note(path: Path) -> str:
    try:
        stat = path.stat()
    except OSError as exc:
        return f", which cannot be read ({exc.strerror or exc})"
    return f", written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stat.st_mtime))}"


def _port_open(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def token_refused(address: str | None) -> str | None:
    """The head's refusal of this process's token at ``address`` (Ray's reason, e.g.
    ``InvalidAuthToken: Authentication token is missing or incorrect``), or ``None``: the head took
    it, is not listening yet, or could not be asked (no address, another Ray version)."""
    if address is None or not _port_open(address):
        return None
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # ray.init uses it  # noqa: PLC0415
        from ray.exceptions import AuthenticationError  # noqa: PLC0415
    except ImportError:
        return None
    try:
        GcsClient(address=address).internal_kv_get(b"rlc-token-check", None, timeout=ASK_TIMEOUT_S)
    except AuthenticationError as exc:
        reason = str(getattr(exc, "message", "") or exc).removeprefix("RPC error: ")
        return reason.split(". ", 1)[0]
    except Exception:  # noqa: BLE001 - anything else is for ray.init to report
        return None
    return None


def refused_message(address: str, reason: str, env: Mapping[str, str] | None = None) -> str:
    """The error for a head that refused this process's token: the address, Ray's reason, where the
    token came from, and what to do."""
    return (f"the Ray head at {address} refused this process's token ({reason}); the token came from "
            f"{token_source(env)}. Waiting cannot help: the Ray cluster there was started with another "
            "token, e.g. an earlier run's Ray still running on this machine (`ray stop` ends it); stop it "
            "or give this run another cluster.ray.port")


__all__ = ["join_address", "refused_message", "token_refused", "token_source"]
