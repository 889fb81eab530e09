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

The scheduler side (`P2PScheduler`) admits and holds prefills, signs the params, checks a
consumer's params and plans its pulls; the worker side (`P2PWorker`) serves held blocks and
pulls them (p2p_worker.py). Holds reach the worker side in the metadata the engine core hands it at the end
of the step the request finished in, before its output leaves the engine. A pull moves a
whole block of every layer and KV head, so p2p runs with one tensor-parallel rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request
from agentrt.engine.errors import ErrorCode
from agentrt.engine.kv_transfer.auth import KVAuthError, ParamsSigner
from agentrt.engine.kv_transfer.base import KVConnectorScheduler, KVLayout, content_key
from agentrt.engine.records import SchedulerOutput

logger = logging.getLogger(__name__)


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
class HoldPlan:
    """A finished prefill's blocks a consumer may fetch, until `deadline`."""

    block_ids: list[int]
    key: str  # content key of the tokens the blocks hold
    deadline: float  # time.monotonic() after which the blocks go back unsent


@dataclass(frozen=True, slots=True)
class P2PMetadata:
    """From the scheduler side: pulls to start (by request), prefills to hold, and
    producers to tell that a consumer needs none of their blocks (all cached here)."""

    loads: dict[str, PullPlan] = field(default_factory=dict)
    holds: dict[str, HoldPlan] = field(default_factory=dict)
    releases: list[PullPlan] = field(default_factory=list)


class P2PScheduler(KVConnectorScheduler):
    def __init__(
        self, config: KVTransferConfig, layout: KVLayout, kv: KVCacheManager, port: int | None
    ) -> None:
        """`port`: where the worker side serves held blocks (a producer's)."""
        super().__init__(config, layout, kv)
        assert config.secret is not None  # KVTransferConfig requires it for p2p
        self.port = port
        self._signer = ParamsSigner(config.secret)
        self._reserved: dict[str, int] = {}  # producer: blocks of admitted holds still running
        self._holds: dict[str, HoldPlan] = {}  # producer: new holds for the worker side
        self._releases: list[PullPlan] = []  # consumer: producers to tell
        self._tried: set[str] = set()  # consumer: requests that had their one transfer

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
        num_held = self._num_held()
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
        return int(self.config.max_held_fraction * self.kv.num_blocks)

    def _num_held(self, more: Iterable[int] = ()) -> int:
        """Physical blocks pinned by held requests (all of each one's blocks stay until sent),
        with `more`: distinct blocks, so a prefix the prefix cache shares between held
        requests counts once (counted once per request, a few holds of one long shared
        prompt reached the cap and refused everyone's)."""
        held = {b for req_id in self.held for b in self.kv.block_ids(req_id)}
        return len(held.union(more))

    def request_finished(self, request: Request) -> dict | None:
        self._tried.discard(request.req_id)
        self._reserved.pop(request.req_id, None)
        return super().request_finished(request)

    def _hold(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
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
        num_held = self._num_held()
        max_held = self._max_held()
        # Admission reserved room for it; this guards against what the reservation did not
        # foresee (a hold never admitted, e.g. after a restart of the accounting).
        if self._num_held(block_ids) > max_held:
            self.stats.num_holds_refused += 1
            refused = (
                f"{num_held} of the {max_held} blocks this producer may hold for consumers "
                f"are held; the consumer computes the prompt (kv_max_held_fraction)"
            )
            logger.warning("request %s's prefill is not held: %s", request.req_id, refused)
            return False, self._signer.sign(
                {"do_remote_prefill": False, "hold_refused": refused}, ttl
            )
        key = content_key(request.prompt_token_ids[: num_blocks * bs], bs)
        self._holds[request.req_id] = HoldPlan(block_ids[:num_blocks], key, time.monotonic() + ttl)
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
            self.stats.num_load_failures += 1
            return 0
        num_remote = params["remote_num_tokens"]
        if num_computed_tokens >= num_remote:  # all cached here: release the producer's copy
            self._releases.append(self._plan(params, 0, []))
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

    def _plan_load(self, request: Request, block_ids: list[int], num_tokens: int) -> PullPlan:
        bs = self.layout.block_size
        first = request.num_computed_tokens // bs
        local = block_ids[first : first + num_tokens // bs]
        return self._plan(request.sampling_params.kv_transfer_params, first, local)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> P2PMetadata:
        holds, self._holds = self._holds, {}
        releases, self._releases = self._releases, []
        return P2PMetadata(self._take_planned(), holds, releases)

    def take_pending_meta(self) -> P2PMetadata | None:
        if not (self._planned or self._holds or self._releases):
            return None
        return self.build_connector_meta(SchedulerOutput([], 0), {})
