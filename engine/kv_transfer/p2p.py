"""P2PConnector: a finished prefill's KV blocks fetched by another running instance
(disaggregated prefill/decode), over ZMQ TCP sockets.

The flow is vLLM's (NIXL connector), driven by a proxy (`agentrt proxy`):

1. The proxy sends the request to a producer with `max_tokens=1` and
   `kv_transfer_params={"do_remote_decode": True}`. The producer computes the prompt and,
   when the request finishes, keeps its blocks and returns in `kv_transfer_params` where
   they are: its address, request id, block ids, how many tokens they hold (whole blocks,
   all but the last prompt token) and the content key of those tokens, signed with the
   secret the instances share (auth.py). The blocks it holds are capped at
   `max_held_fraction` of its pool: a `do_remote_decode` request is admitted only if the
   blocks held, those reserved by the holds still computing, and its own fit under the cap
   (otherwise it fails at once with `ErrorCode.OVERLOADED`, which the server answers with
   429 and Retry-After; one that could never fit is INVALID_REQUEST, a 400); if a hold
   still does not fit when the prefill ends, the producer
   keeps nothing and says so (`do_remote_prefill: false` and `hold_refused`).
2. The proxy sends the same request to a consumer with those params. It checks them (the
   signature and expiry, the engine id, this request's tokens by key, the producer among
   `allowed_producers` if set) and parks the request in `WAITING_FOR_REMOTE_KVS`; a
   connector thread asks the producer for the blocks (one authenticated message) and writes
   what comes back into the blocks the request was given. The request then computes only
   the rest of its prompt and decodes.
3. The producer frees the blocks once it answered, or after `hold_timeout_s` if no consumer
   came.

Anything that goes wrong on the way (params that do not match, a producer that is gone or
does not answer within `timeout_s`, an unknown request, a MAC or digest mismatch) makes the
consumer compute the prefill itself; it is logged and counted, never raised.

The wire (one request, one answer):
- ask, consumer -> producer, one frame: JSON `{req_id, block_ids, engine_id, key, nonce,
  mac}`, the MAC (under the secret's "wire" key) over the other fields.
- answer, producer -> consumer, two frames: JSON `{ok, nonce, key, digest, mac}` and the
  blocks' bytes; the MAC covers the ask's nonce (this answer is for this ask), the key and
  the SHA-256 `digest` of the bytes. A refusal is `{ok: false, error}` and no bytes.
The producer checks the MAC before anything else, then the engine id, the request id, the
content key and the block ids against what it holds, and only then takes the held entry
(an unauthenticated or wrong ask frees nothing and reads nothing). Messages above
`MAX_ASK_BYTES` are cut off by ZMQ (MAXMSGSIZE); a malformed one is answered with an
error, or dropped, and the loop goes on.

Below the messages, the socket is ZMQ CURVE (encrypted, and the producer authenticated): the
producer's key pair is derived from the secret, so only a peer that holds the secret knows
the producer's public key and can complete the handshake at all; each consumer connection
uses a fresh key pair. A peer without the secret reaches nothing but the handshake.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass

import torch
import zmq
from zmq.utils import z85

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.core.request import Request
from agentrt.engine.errors import ConfigError, ErrorCode
from agentrt.engine.kv_transfer.auth import (
    KVAuthError,
    ParamsSigner,
    canonical,
    derive_key,
    mac,
    verify,
)
from agentrt.engine.kv_transfer.base import KVConnector, KVLayout, content_key

logger = logging.getLogger(__name__)

MAX_ASK_BYTES = 1 << 20  # an ask names at most max_model_len / block_size block ids
_ANSWER_SLACK_BYTES = 1 << 16  # the answer's JSON frame


def curve_server_keys(secret: str) -> tuple[bytes, bytes]:
    """The producer's CURVE key pair (public, secret; Z85), derived from the shared secret."""
    secret_key = z85.encode(derive_key(secret, "wire curve"))
    return zmq.curve_public(secret_key), secret_key


@dataclass(frozen=True, slots=True)
class PullPlan:
    """Fetch `remote_block_ids` of `remote_req_id` (whose prefix has content `key`) from
    host:port into `block_ids`."""

    host: str
    port: int
    remote_req_id: str
    remote_block_ids: list[int]
    key: str
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class _Held:
    block_ids: list[int]  # the blocks a consumer may fetch
    num_pinned: int  # the request's blocks, all kept until then
    key: str  # content key of the tokens the blocks hold
    deadline: float  # time.monotonic() after which the blocks go back unsent


class P2PConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        assert config.secret is not None  # KVTransferConfig requires it for p2p
        if not zmq.has("curve"):
            raise ConfigError(
                "kv_connector='p2p' needs pyzmq built with CURVE (its wheels are): reinstall "
                "pyzmq from a wheel."
            )
        self._signer = ParamsSigner(config.secret)
        self._wire_key = derive_key(config.secret, "wire")
        self._server_public, self._server_secret = curve_server_keys(config.secret)
        self._context = zmq.Context()
        self._held: dict[str, _Held] = {}  # producer: finished prefills kept for a consumer
        self._reserved: dict[str, int] = {}  # producer: blocks of admitted holds still running
        self._sent: list[str] = []  # producer: requests whose blocks may be freed
        self._tried: set[str] = set()  # consumer: requests that had their one transfer
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

    # -- producer ----------------------------------------------------------------------------

    def admit(self, request: Request) -> tuple[ErrorCode, str] | None:
        """Refuse a `do_remote_decode` request whose blocks (its prompt and max_tokens, all
        pinned until a consumer fetches them) would take the held blocks past the cap
        (OVERLOADED), or could never fit under it (INVALID_REQUEST); otherwise reserve them
        until it finishes."""
        params = request.sampling_params.kv_transfer_params or {}
        if not self.config.saves or not params.get("do_remote_decode"):
            return None
        bs = self.layout.block_size
        num_blocks = -(-(request.num_prompt_tokens + request.max_tokens) // bs)
        with self._lock:
            num_held = sum(held.num_pinned for held in self._held.values())
            num_reserved = sum(self._reserved.values())
            max_held = self._max_held()
            refusal = None
            if num_blocks > max_held:
                refusal = (
                    ErrorCode.INVALID_REQUEST,
                    f"do_remote_decode: the prompt and max_tokens take {num_blocks} KV blocks, "
                    f"more than the {max_held} this producer may hold for consumers at all "
                    "(kv_max_held_fraction); send fewer tokens (the prefill needs max_tokens=1)",
                )
            elif num_held + num_reserved + num_blocks > max_held:
                refusal = (
                    ErrorCode.OVERLOADED,
                    f"this producer holds {num_held} and has reserved {num_reserved} of the "
                    f"{max_held} KV blocks it may hold for consumers (kv_max_held_fraction); "
                    f"a prefill of {num_blocks} more blocks to hold is refused: retry later",
                )
            if refusal is not None:
                self.stats.num_holds_refused += 1
                return refusal
            self._reserved[request.req_id] = num_blocks
        return None

    def _max_held(self) -> int:
        return int(self.config.max_held_fraction * len(self.kv_caches[0]))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._tried.discard(request.req_id)
        with self._lock:
            self._reserved.pop(request.req_id, None)
        params = request.sampling_params.kv_transfer_params or {}
        if (
            not self.config.saves
            or not params.get("do_remote_decode")
            or request.status.finish_reason not in ("stop", "length")
        ):
            return False, None
        bs = self.layout.block_size
        num_blocks = min((request.num_prompt_tokens - 1) // bs, len(block_ids))
        if num_blocks == 0:
            return False, None  # less than a block: the consumer computes it all
        ttl = self.config.hold_timeout_s
        with self._lock:
            num_held = sum(held.num_pinned for held in self._held.values())
            max_held = self._max_held()
            # Admission reserved room for it; this guards against what the reservation did
            # not foresee (a hold never admitted, e.g. after a restart of the accounting).
            if num_held + len(block_ids) > max_held:
                self.stats.num_holds_refused += 1
                refused = (
                    f"{num_held} of the {max_held} blocks this producer may hold for consumers "
                    f"are held; the consumer computes the prompt (kv_max_held_fraction)"
                )
            else:
                key = content_key(request.prompt_token_ids[: num_blocks * bs], bs)
                deadline = time.monotonic() + ttl
                held = _Held(block_ids[:num_blocks], len(block_ids), key, deadline)
                self._held[request.req_id] = held
                refused = None
        if refused is not None:
            logger.warning("request %s's prefill is not held: %s", request.req_id, refused)
            return False, self._signer.sign(
                {"do_remote_prefill": False, "hold_refused": refused}, ttl
            )
        return True, self._signer.sign(
            {
                "do_remote_prefill": True,
                "remote_engine_id": self.layout.engine_id,
                "remote_host": self.config.host,
                "remote_port": self.port,
                "remote_request_id": request.req_id,
                "remote_block_ids": block_ids[:num_blocks],
                "remote_num_tokens": num_blocks * bs,
                "remote_key": key,
            },
            ttl,
        )

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
                self.stats.num_saved_blocks += len(block_ids)
        answer = {
            "ok": True,
            "nonce": fields["nonce"],
            "key": key,
            "digest": hashlib.sha256(data).hexdigest(),
        }
        return {**answer, "mac": mac(self._wire_key, b"answer", canonical(answer))}, data

    # -- consumer ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.sampling_params.kv_transfer_params or {}
        if (
            not self.config.loads
            or not params.get("do_remote_prefill")
            or request.req_id in self._tried  # after a preemption it recomputes
        ):
            return 0
        self._tried.add(request.req_id)
        problem = self._check(request, params)
        if problem is not None:
            logger.warning("request %s cannot use the remote prefill: %s", request.req_id, problem)
            with self._lock:
                self.stats.num_load_failures += 1
            return 0
        num_remote = params["remote_num_tokens"]
        if num_computed_tokens >= num_remote:  # all cached here: release the producer's copy
            self._pool.submit(self._release, self._plan(params, 0, []))
            return 0
        return num_remote - num_computed_tokens

    def _check(self, request: Request, params: dict) -> str | None:
        """Why the request cannot load these params' blocks, or None. The Processor checked
        the signature when the request came in; checked again here, where it is acted on."""
        bs = self.layout.block_size
        try:
            self._signer.verify(params)
            num, block_ids = int(params["remote_num_tokens"]), list(params["remote_block_ids"])
            if params["remote_engine_id"] != self.layout.engine_id:
                return "the producer runs another model, dtype, quantization or block size"
            if num % bs or len(block_ids) != num // bs or not 0 < num < request.num_tokens:
                return f"remote_num_tokens={num} does not fit the prompt and block ids"
            if content_key(request.all_token_ids[:num], bs) != params["remote_key"]:
                return "the producer's prompt has other tokens"
            address = f"{params['remote_host']}:{int(params['remote_port'])}"
            allowed = self.config.allowed_producers
            if allowed and address not in allowed:
                return f"the producer {address} is not among kv_allowed_producers"
            if not isinstance(params["remote_request_id"], str):
                return "remote_request_id is not a string"
        except KVAuthError as exc:
            return f"kv_transfer_params refused: {exc}"
        except (KeyError, TypeError, ValueError) as exc:
            return f"malformed kv_transfer_params ({type(exc).__name__}: {exc})"
        return None

    def _plan(self, params: dict, first: int, block_ids: list[int]) -> PullPlan:
        n = len(block_ids)
        return PullPlan(
            host=params["remote_host"],
            port=int(params["remote_port"]),
            remote_req_id=params["remote_request_id"],
            remote_block_ids=params["remote_block_ids"][first : first + n],
            key=params["remote_key"],
            block_ids=block_ids,
            num_tokens=n * self.layout.block_size,
        )

    def _release(self, plan: PullPlan) -> None:
        """Ask for none of the blocks: the producer frees them now, not at its hold timeout."""
        try:
            self._load("", plan)
        except Exception as exc:  # noqa: BLE001 - the producer's timeout frees them anyway
            logger.info("could not release request %s's KV: %s", plan.remote_req_id, exc)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        bs = self.layout.block_size
        first = request.num_computed_tokens // bs
        local = block_ids[first : first + num_external_tokens // bs]
        self._planned[request.req_id] = self._plan(
            request.sampling_params.kv_transfer_params, first, local
        )

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
