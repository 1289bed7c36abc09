"""What travels between machines: frames of a JSON header plus raw bytes (never pickle), the shared-secret token
read from an owner-only file, and the challenge / proof of the join handshake (HMAC-SHA256, compared in constant
time: the token itself never crosses the network).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import struct

_LENGTHS = struct.Struct("<IQ")  # header bytes, payload bytes
MAX_HEADER = 64 << 20  # a load request carries the checkpoint's parsed header (at most 16 MiB of JSON as read)
HELLO_LIMIT = 64 << 10  # before a connection proved its secret: a hello, nothing large
MAX_PAYLOAD = 1 << 40
MIN_TOKEN_BYTES = 16


class WireError(ConnectionError):
    """The other side closed the connection or sent something that is not a frame."""


def send_frame(sock: socket.socket, header: dict, payload: bytes | memoryview = b"") -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LENGTHS.pack(len(data), len(payload)) + data)
    if len(payload):
        sock.sendall(payload)


def recv_frame(sock: socket.socket, limit: int = MAX_HEADER) -> tuple[dict, bytes]:
    """One frame; limit: the most header bytes accepted (a connection that has not proved its secret: HELLO_LIMIT,
    and no payload)."""
    header_len, payload_len = _LENGTHS.unpack(_recv_exact(sock, _LENGTHS.size))
    if header_len > limit or payload_len > (MAX_PAYLOAD if limit == MAX_HEADER else 0):
        raise WireError(f"a frame of {header_len} + {payload_len} bytes is over the limits: not our protocol")
    try:
        header = json.loads(_recv_exact(sock, header_len))
    except ValueError as error:
        raise WireError(f"a frame whose header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise WireError("a frame whose header is not a JSON object")
    return header, _recv_exact(sock, payload_len) if payload_len else b""


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    buffer = bytearray(count)
    view, got = memoryview(buffer), 0
    while got < count:
        chunk = sock.recv_into(view[got:], count - got)
        if not chunk:
            raise WireError("the connection was closed")
        got += chunk
    return bytes(buffer)


def read_token(path: str) -> bytes:
    """The shared secret in `path`: a file only its owner may read (chmod 600), at least MIN_TOKEN_BYTES long."""
    path = os.path.expanduser(path)
    try:
        info = os.stat(path)
        with open(path, "rb") as handle:
            token = handle.read().strip()
    except OSError as error:
        raise ValueError(f"token file {path!r} cannot be read: {error}; make one with "
                         f"`python -c \"import secrets; print(secrets.token_hex(32))\" > {path}; chmod 600 {path}`") \
            from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"token file {path!r} is readable by other users (mode {stat.filemode(info.st_mode)}): "
                         f"run `chmod 600 {path}`")
    if len(token) < MIN_TOKEN_BYTES:
        raise ValueError(f"token file {path!r} holds {len(token)} bytes, fewer than {MIN_TOKEN_BYTES}: write a long "
                         f"random secret, e.g. `python -c \"import secrets; print(secrets.token_hex(32))\"`")
    return token


def new_challenge() -> str:
    return secrets.token_hex(32)


def proof(token: bytes, challenge: str, purpose: str) -> str:
    """What the joiner answers to a challenge: HMAC(token, purpose + challenge)."""
    return hmac.new(token, f"{purpose}:{challenge}".encode(), hashlib.sha256).hexdigest()


def proof_matches(token: bytes, challenge: str, purpose: str, answer) -> bool:
    return isinstance(answer, str) and hmac.compare_digest(proof(token, challenge, purpose).encode(),
                                                           answer.encode())
