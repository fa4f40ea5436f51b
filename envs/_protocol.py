"""Wire protocol between pools and env workers.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. Requests are maps
`{"v": PROTOCOL_VERSION, "id": int >= 0, "op": str, "args": map}`; replies are
`{"v": PROTOCOL_VERSION, "id": int, "ok": bool, "result": any}` or, on failure,
`{"v", "id", "ok": false, "error": {"kind": str, "message": str}}`. A reply to a frame whose id could not be
read carries id -1. Everything is validated on receipt.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Mapping

import msgpack

# 2: step results carry typed `outcome`, `call` and `verdict` (StepResult.to_wire); 1 had them in `info`.
PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 8 << 20
OPS = ("hello", "ping", "reset", "step", "close", "snapshot", "restore")
_HEADER = struct.Struct(">I")


class ProtocolError(ValueError):
  """A frame or message is malformed. `kind` names the failure for the error reply; `req_id` if known."""

  def __init__(self, kind: str, message: str, req_id: int = -1):
    super().__init__(message)
    self.kind, self.req_id = kind, req_id


class ConnectionClosed(ConnectionError):
  """The peer closed the connection (EOF in the middle of or before a frame)."""


def pack(msg: Mapping[str, Any]) -> bytes:
  body = msgpack.packb(msg, use_bin_type=True)
  return _HEADER.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  buf = bytearray()
  while len(buf) < n:
    chunk = sock.recv(min(n - len(buf), 1 << 20))
    if not chunk:
      raise ConnectionClosed(f"connection closed after {len(buf)} of {n} bytes")
    buf += chunk
  return bytes(buf)


def read_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> Any:
  """One decoded frame. Raises ProtocolError for a bad frame (the stream stays in sync: an oversize body is
  read and discarded), ConnectionClosed at EOF."""
  (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
  if n > max_bytes:
    left = n
    while left:
      left -= len(_recv_exact(sock, min(left, 1 << 20)))
    raise ProtocolError("frame_too_large", f"frame of {n} bytes exceeds the limit of {max_bytes}")
  body = _recv_exact(sock, n)
  try:
    return msgpack.unpackb(body, raw=False, strict_map_key=True)
  except Exception as e:  # msgpack raises several unrelated types for corrupt input.
    raise ProtocolError("bad_msgpack", f"frame is not msgpack: {type(e).__name__}: {e}") from None


def validate_request(msg: Any) -> tuple[int, str, dict[str, Any]]:
  """(id, op, args) of a request, or ProtocolError naming what is wrong."""
  if not isinstance(msg, dict):
    raise ProtocolError("bad_request", f"a request is a map, got {type(msg).__name__}")
  req_id = msg.get("id")
  if type(req_id) is not int or req_id < 0:
    raise ProtocolError("bad_request", f"id={req_id!r}: must be an int >= 0")
  if msg.get("v") != PROTOCOL_VERSION:
    raise ProtocolError("bad_version", f"protocol version {msg.get('v')!r}: this worker speaks {PROTOCOL_VERSION}",
                        req_id)
  op = msg.get("op")
  if op not in OPS:
    raise ProtocolError("bad_op", f"op={op!r}: not one of {OPS}", req_id)
  args = msg.get("args", {})
  if not isinstance(args, dict):
    raise ProtocolError("bad_args", f"args must be a map, got {type(args).__name__}", req_id)
  extra = set(msg) - {"v", "id", "op", "args"}
  if extra:
    raise ProtocolError("bad_request", f"unknown request fields {sorted(extra)}", req_id)
  return req_id, op, args


def request(req_id: int, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
  return {"v": PROTOCOL_VERSION, "id": req_id, "op": op, "args": dict(args)}


def ok_reply(req_id: int, result: Any) -> dict[str, Any]:
  return {"v": PROTOCOL_VERSION, "id": req_id, "ok": True, "result": result}


def error_reply(req_id: int, kind: str, message: str) -> dict[str, Any]:
  return {"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "error": {"kind": kind, "message": message[:2000]}}


def validate_reply(msg: Any) -> tuple[int, bool, Any]:
  """(id, ok, result-or-error) of a reply, or ProtocolError."""
  if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION or type(msg.get("id")) is not int \
      or type(msg.get("ok")) is not bool:
    raise ProtocolError("bad_reply", f"malformed reply {str(msg)[:200]!r}")
  if msg["ok"]:
    return msg["id"], True, msg.get("result")
  err = msg.get("error")
  if not isinstance(err, dict) or not isinstance(err.get("kind"), str):
    raise ProtocolError("bad_reply", f"malformed error reply {str(msg)[:200]!r}")
  return msg["id"], False, err
