"""P2PWorker: the worker side of the p2p connector (p2p.py has the flow and the wire): a
producer serves held blocks on a ZMQ CURVE socket; a consumer pulls them into its blocks."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
import threading
import time

import torch
import zmq
from zmq.utils import z85

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.errors import ConfigError
from agentrt.engine.kv_transfer.auth import KVAuthError, canonical, derive_key, mac, verify
from agentrt.engine.kv_transfer.base import KVConnectorWorker, KVLayout
from agentrt.engine.kv_transfer.p2p import HoldPlan, P2PMetadata, PullPlan

logger = logging.getLogger(__name__)

MAX_ASK_BYTES = 1 << 20  # an ask names at most max_model_len / block_size block ids
_ANSWER_SLACK_BYTES = 1 << 16  # the answer's JSON frame


def curve_server_keys(secret: str) -> tuple[bytes, bytes]:
    """The producer's CURVE key pair (public, secret; Z85), derived from the shared secret."""
    secret_key = z85.encode(derive_key(secret, "wire curve"))
    return zmq.curve_public(secret_key), secret_key


class P2PWorker(KVConnectorWorker):
    metadata_type = P2PMetadata

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        assert config.secret is not None  # KVTransferConfig requires it for p2p
        if not zmq.has("curve"):
            raise ConfigError(
                "kv_connector='p2p' needs pyzmq built with CURVE (its wheels are): reinstall "
                "pyzmq from a wheel."
            )
        self._wire_key = derive_key(config.secret, "wire")
        self._server_public, self._server_secret = curve_server_keys(config.secret)
        self._context = zmq.Context()
        self._held: dict[str, HoldPlan] = {}  # producer: finished prefills kept for a consumer
        self._sent: list[str] = []  # producer: requests whose blocks may be freed
        self.port: int | None = None
        self._server: threading.Thread | None = None
        self._stop = threading.Event()
        if config.saves:
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_ASK_BYTES)
            socket.curve_secretkey = self._server_secret
            socket.curve_publickey = self._server_public
            socket.curve_server = True
            address = f"tcp://{config.host}"
            if config.port:
                socket.bind(f"{address}:{config.port}")
                self.port = config.port
            else:
                self.port = socket.bind_to_random_port(address)
            self._server = threading.Thread(
                target=self._serve, args=(socket,), name="agentrt-kv-server", daemon=True
            )
            self._server.start()

    def start_load_kv(self) -> None:
        """Start the pulls, take the new holds, and tell producers of releases."""
        super().start_load_kv()
        if self._meta is None:
            return
        with self._lock:
            self._held.update(self._meta.holds)
        for plan in self._meta.releases:
            self._pool.submit(self._release, plan)

    # -- producer ----------------------------------------------------------------------------

    def _take_finished_sends(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            expired = [r for r, held in self._held.items() if held.deadline < now]
            for req_id in expired:
                logger.warning("no consumer fetched the KV of request %s: freed", req_id)
                del self._held[req_id]
            sent, self._sent = self._sent + expired, []
        return sent

    def _serve(self, socket: zmq.Socket) -> None:
        """Answer asks until shutdown. Nothing a peer sends ends this loop."""
        while not self._stop.is_set():
            try:
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 2:  # the peer's identity and one ask: anything else is dropped
                logger.warning("dropped a KV ask of %d frames (expected 1)", len(frames) - 1)
                continue
            identity, message = frames
            try:
                header, payload = self._answer(message)
            except KVAuthError as exc:
                logger.warning("refused an unauthenticated KV ask: %s", exc)
                header, payload = {"ok": False, "error": "not authenticated"}, b""
            except Exception as exc:  # noqa: BLE001 - the consumer falls back on any error
                header, payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""
            try:
                socket.send_multipart([identity, json.dumps(header).encode(), payload], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.info("could not answer a KV ask: %s", exc)
        socket.close()

    def _answer(self, message: bytes) -> tuple[dict, bytes]:
        try:
            ask = json.loads(message)
        except ValueError:
            raise KVAuthError("not JSON") from None
        if not isinstance(ask, dict):
            raise KVAuthError("not a JSON object")
        fields = {k: v for k, v in ask.items() if k != "mac"}
        if not verify(self._wire_key, ask.get("mac"), b"ask", canonical(fields)):
            raise KVAuthError("no valid MAC (a peer without this instance's kv_secret)")
        req_id, key, block_ids = fields["req_id"], fields["key"], fields["block_ids"]
        if not isinstance(block_ids, list) or not all(type(b) is int for b in block_ids):
            raise ValueError("block_ids must be a list of block ids")
        with self._lock:
            held = self._held.get(req_id)
            if held is None:
                raise KeyError(f"request {req_id} is not held (expired, or already sent)")
            if fields["engine_id"] != self.layout.engine_id:
                raise ValueError("the consumer runs another model, dtype or block size")
            if not isinstance(key, str) or not hmac.compare_digest(key, held.key):
                raise ValueError("the consumer's prompt has other tokens")
            if not set(block_ids) <= set(held.block_ids):
                raise ValueError("asked for blocks the request does not hold")
            del self._held[req_id]
            self._sent.append(req_id)
            data = b""
            if block_ids:  # none: the consumer had them all already
                # The held blocks cannot change or be freed before the copy is taken.
                data = self._read_blocks(block_ids).view(torch.uint8).numpy().tobytes()
                self.num_saved_blocks += len(block_ids)
        answer = {
            "ok": True,
            "nonce": fields["nonce"],
            "key": key,
            "digest": hashlib.sha256(data).hexdigest(),
        }
        return {**answer, "mac": mac(self._wire_key, b"answer", canonical(answer))}, data

    # -- consumer ----------------------------------------------------------------------------

    def _release(self, plan: PullPlan) -> None:
        """Ask for none of the blocks: the producer frees them now, not at its hold timeout."""
        try:
            self._load("", plan)
        except Exception as exc:  # noqa: BLE001 - the producer's timeout frees them anyway
            logger.info("could not release request %s's KV: %s", plan.remote_req_id, exc)

    def _load(self, req_id: str, plan: PullPlan) -> int:
        """Ask the producer for the blocks and write them into the pool."""
        num_bytes = len(plan.block_ids) * self._block_bytes()
        ask = {
            "req_id": plan.remote_req_id,
            "block_ids": plan.remote_block_ids,
            "engine_id": self.layout.engine_id,
            "key": plan.key,
            "nonce": secrets.token_hex(16),
        }
        ask["mac"] = mac(self._wire_key, b"ask", canonical(ask))
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, num_bytes + _ANSWER_SLACK_BYTES)
        socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()
        socket.curve_serverkey = self._server_public
        try:
            socket.connect(f"tcp://{plan.host}:{plan.port}")
            socket.send(json.dumps(ask).encode())
            if not socket.poll(int(self.config.timeout_s * 1000)):
                raise TimeoutError(
                    f"no answer from {plan.host}:{plan.port} in {self.config.timeout_s:g} s"
                )
            frames = socket.recv_multipart()
        finally:
            socket.close()
        payload = self._checked_answer(frames, ask["nonce"], plan.key, num_bytes)
        if not plan.block_ids:
            return 0
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.layout.dtype)
        self._write_blocks(plan.block_ids, data.view(len(plan.block_ids), *self.layout.block_shape))
        return plan.num_tokens

    def _checked_answer(self, frames: list[bytes], nonce: str, key: str, num_bytes: int) -> bytes:
        """The blocks' bytes of an answer to the ask `nonce`; raises unless the producer
        authenticated them."""
        if len(frames) != 2:
            raise ValueError(f"an answer of {len(frames)} frames")
        header, payload = frames
        answer = json.loads(header)
        if not answer.get("ok"):
            raise RuntimeError(f"the producer refused: {answer.get('error')}")
        fields = {k: v for k, v in answer.items() if k != "mac"}
        if not verify(self._wire_key, answer.get("mac"), b"answer", canonical(fields)):
            raise KVAuthError("the answer has no valid MAC")
        if fields.get("nonce") != nonce or fields.get("key") != key:
            raise KVAuthError("the answer is for another ask")
        if fields.get("digest") != hashlib.sha256(payload).hexdigest() or len(payload) != num_bytes:
            raise ValueError("the data does not match its digest or size")
        return payload

    def _block_bytes(self) -> int:
        return math.prod(self.layout.block_shape) * self.layout.dtype.itemsize

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join()
        super().shutdown()
        self._context.destroy(linger=0)


def release_hold(params: dict, secret: str, timeout_s: float) -> bool:
    """Tell the producer that signed `params` (a consumer's `kv_transfer_params`) to free the
    blocks it holds for them now, not at its hold timeout: what a consumer's worker does for
    a request that needs none of them, for a front end whose request failed before it reached
    the engine (a decode that can never run leaves the hold pinned otherwise). The same
    authenticated ask with no blocks; returns whether the producer acknowledged it. Raises
    KVAuthError for params not signed with `secret`."""
    from agentrt.engine.kv_transfer.auth import ParamsSigner

    ParamsSigner(secret).verify(params)
    wire_key = derive_key(secret, "wire")
    server_public, _ = curve_server_keys(secret)
    ask = {
        "req_id": params["remote_request_id"],
        "block_ids": [],
        "engine_id": params["remote_engine_id"],
        "key": params["remote_key"],
        "nonce": secrets.token_hex(16),
    }
    ask["mac"] = mac(wire_key, b"ask", canonical(ask))
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, _ANSWER_SLACK_BYTES)
    socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()
    socket.curve_serverkey = server_public
    try:
        socket.connect(f"tcp://{params['remote_host']}:{int(params['remote_port'])}")
        socket.send(json.dumps(ask).encode())
        if not socket.poll(int(timeout_s * 1000)):
            return False
        frames = socket.recv_multipart()
    finally:
        socket.close()
    answer = json.loads(frames[0]) if frames else {}
    fields = {k: v for k, v in answer.items() if k != "mac"}
    return bool(answer.get("ok")) and verify(
        wire_key, answer.get("mac"), b"answer", canonical(fields)
    )
