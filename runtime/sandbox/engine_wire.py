"""The framing between a worker (or a server) and an engine's host process.

A frame is ``<u32 length><u8 kind>`` and ``length`` bytes of payload over a stream socket. Nothing is
pickled: the host runs candidate code, and unpickling what it sends would run its code in the worker.
The worker reads the host's frames as plain bytes and numbers, bounded and checked.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_FRAME", "FrameError", "decode_batch", "decode_result", "encode_batch", "encode_result",
           "read_frame", "write_frame"]  # fmt: skip

MAX_FRAME = 256 << 20
_HEAD = struct.Struct("<IB")
_BATCH = struct.Struct("<QI")
_RESULT = struct.Struct("<QII")


class FrameError(ValueError):
    """A frame that breaks the protocol (too long, truncated, of the wrong shape)."""


def write_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    sock.sendall(_HEAD.pack(len(payload), kind[0]) + payload)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> tuple[bytes, bytes] | None:
    """The next ``(kind, payload)``, or ``None`` once the other side has closed."""
    head = _exactly(sock, _HEAD.size)
    if head is None:
        return None
    length, kind = _HEAD.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"a frame of {length} bytes (at most {MAX_FRAME})")
    payload = _exactly(sock, length) if length else b""
    if payload is None:
        return None
    return bytes([kind]), payload


def encode_batch(batch_id: int, seqs: Sequence[np.ndarray]) -> bytes:
    lengths = np.array([len(s) for s in seqs], np.uint32)
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
    return _BATCH.pack(batch_id, len(seqs)) + lengths.tobytes() + ids.tobytes()


def decode_batch(payload: bytes) -> tuple[int, list[np.ndarray]]:
    batch_id, n = _BATCH.unpack_from(payload)
    lengths = np.frombuffer(payload, np.uint32, n, _BATCH.size)
    ids = np.frombuffer(payload, np.int32, offset=_BATCH.size + 4 * n)
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return batch_id, [ids[bounds[i] : bounds[i + 1]].copy() for i in range(n)]


def encode_result(batch_id: int, out: np.ndarray) -> bytes:
    out = np.ascontiguousarray(out, np.float32)
    return _RESULT.pack(batch_id, out.shape[0], out.shape[1]) + out.tobytes()


def decode_result(payload: bytes, dim: int) -> tuple[int, np.ndarray]:
    """A result frame's batch id and its ``[n, dim]`` embeddings; :class:`FrameError` for any other shape."""
    if len(payload) < _RESULT.size:
        raise FrameError("a truncated result")
    batch_id, n, d = _RESULT.unpack_from(payload)
    if d != dim or len(payload) != _RESULT.size + 4 * n * d:
        raise FrameError(f"a result of {n} x {d} in {len(payload)} bytes (embeddings have {dim} dimensions)")
    return batch_id, np.frombuffer(payload, np.float32, offset=_RESULT.size).reshape(n, d).copy()
