"""P2PConnector: a finished prefill's KV blocks fetched by another running instance
(disaggregated prefill/decode), over ZMQ TCP sockets.

The flow is vLLM's (NIXL connector), driven by a proxy (`agentrt proxy`):

1. The proxy sends the request to a producer with `max_tokens=1` and
   `kv_transfer_params={"do_remote_decode": True}`. The producer computes the prompt and,
   when the request finishes, keeps its blocks and returns in `kv_transfer_params` where
   they are: its address, request id, block ids, how many tokens they hold (whole blocks,
   all but the last prompt token) and the chained content key of those tokens.
2. The proxy sends the same request to a consumer with those params. Its scheduler checks
   them (same engine id, the same tokens by key) and parks the request in
   `WAITING_FOR_REMOTE_KVS`; a connector thread asks the producer for the blocks (one
   message; the answer carries the data and a CRC-32) and writes them into the blocks the
   request was given. The request then computes only the rest of its prompt and decodes.
3. The producer frees the blocks once it answered, or after `hold_timeout_s` if no consumer
   came.

Anything that goes wrong on the way (params that do not match, a producer that is gone or
does not answer within `timeout_s`, an unknown request, a checksum mismatch) makes the
consumer compute the prefill itself; it is logged and counted, never raised.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from dataclasses import dataclass

import torch
import zmq

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.kv_transfer.base import KVConnector, KVLayout, extend_block_keys
from agentrt.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PullPlan:
    """Fetch `remote_block_ids` of `remote_req_id` from host:port into `block_ids`."""

    host: str
    port: int
    remote_req_id: str
    remote_block_ids: list[int]
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class _Held:
    block_ids: list[int]
    deadline: float  # time.monotonic() after which the blocks go back unsent


class P2PConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self._context = zmq.Context()
        self._held: dict[str, _Held] = {}  # producer: finished prefills kept for a consumer
        self._sent: list[str] = []  # producer: requests whose blocks may be freed
        self._tried: set[str] = set()  # consumer: requests that had their one transfer
        self.port: int | None = None
        self._server: threading.Thread | None = None
        self._stop = threading.Event()
        if config.saves:
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
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

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._tried.discard(request.req_id)
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
        tokens = request.prompt_token_ids[: num_blocks * bs]
        deadline = time.monotonic() + self.config.hold_timeout_s
        with self._lock:
            self._held[request.req_id] = _Held(block_ids[:num_blocks], deadline)
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.layout.engine_id,
            "remote_host": self.config.host,
            "remote_port": self.port,
            "remote_request_id": request.req_id,
            "remote_block_ids": block_ids[:num_blocks],
            "remote_num_tokens": num_blocks * bs,
            "remote_key": extend_block_keys([], tokens, bs)[-1],
        }

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
        """Answer consumers until shutdown: each asks once for (a subset of) a request's
        held blocks and gets them, or an error; the blocks are released either way."""
        while not self._stop.is_set():
            if not socket.poll(100):
                continue
            identity, message = socket.recv_multipart()
            try:
                header, payload = self._answer(json.loads(message))
            except Exception as exc:  # noqa: BLE001 - the consumer falls back on any error
                header, payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""
            socket.send_multipart([identity, json.dumps(header).encode(), payload])
        socket.close()

    def _answer(self, ask: dict) -> tuple[dict, bytes]:
        with self._lock:
            held = self._held.pop(ask["req_id"], None)
            if held is None:
                raise KeyError(f"request {ask['req_id']} is not held (expired, or already sent)")
            self._sent.append(ask["req_id"])
            if ask["engine_id"] != self.layout.engine_id:
                raise ValueError("the consumer runs another model, dtype or block size")
            if not set(ask["block_ids"]) <= set(held.block_ids):
                raise ValueError("asked for blocks the request does not hold")
            if not ask["block_ids"]:
                return {"ok": True, "crc32": 0}, b""  # the consumer had them all already
            # The held blocks cannot change or be freed before the copy is taken.
            data = self._read_blocks(ask["block_ids"]).view(torch.uint8).numpy()
            self.stats.num_saved_blocks += len(ask["block_ids"])
        return {"ok": True, "crc32": zlib.crc32(data)}, data.tobytes()

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
        bs = self.layout.block_size
        try:
            num, block_ids = int(params["remote_num_tokens"]), list(params["remote_block_ids"])
            if params["remote_engine_id"] != self.layout.engine_id:
                return "the producer runs another model, dtype, quantization or block size"
            if num % bs or len(block_ids) != num // bs or not 0 < num < request.num_tokens:
                return f"remote_num_tokens={num} does not fit the prompt and block ids"
            tokens = request.all_token_ids[:num]
            if extend_block_keys([], tokens, bs)[-1] != params["remote_key"]:
                return "the producer's prompt has other tokens"
            int(params["remote_port"])
            missing = {"remote_host", "remote_request_id"} - params.keys()
            if missing:
                return f"kv_transfer_params lacks {sorted(missing)}"
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
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(f"tcp://{plan.host}:{plan.port}")
            ask = {
                "req_id": plan.remote_req_id,
                "block_ids": plan.remote_block_ids,
                "engine_id": self.layout.engine_id,
            }
            socket.send(json.dumps(ask).encode())
            if not socket.poll(int(self.config.timeout_s * 1000)):
                raise TimeoutError(
                    f"no answer from {plan.host}:{plan.port} in {self.config.timeout_s:g} s"
                )
            header, payload = socket.recv_multipart()
        finally:
            socket.close()
        answer = json.loads(header)
        if not answer["ok"]:
            raise RuntimeError(f"the producer refused: {answer['error']}")
        if zlib.crc32(payload) != answer["crc32"]:
            raise ValueError("checksum mismatch")
        if not plan.block_ids:
            return 0
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.layout.dtype)
        self._write_blocks(plan.block_ids, data.view(len(plan.block_ids), *self.layout.block_shape))
        return plan.num_tokens

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join()
        super().shutdown()
        self._context.destroy(linger=0)
