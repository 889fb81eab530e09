"""Tensor-parallel process groups and the per-step broadcast (torch.distributed).

Every rank joins through one `TCPStore` (rank 0 hosts it) and holds two groups:

- `control`: gloo, on the CPU. Rank 0 broadcasts each message's header on it: what comes
  next (a step, a KV connector's metadata alone, the connector to start, or shutdown) and
  its sizes, then the KV connector's metadata (bytes, as its worker side encodes them), if
  any. Workers wait for a header without a time limit (an engine may sit idle for hours);
  every other operation has `timeout_s`. The KV connectors' ranks also agree on which of
  their loads are done here (`all_reduce_min`).
- `device`: the group the model's tensors travel on: the control group itself on the CPU,
  NCCL on CUDA. The step's input (one int64 tensor: input ids, positions, slot mapping,
  query start offsets, sequence lengths and block tables, back to back) and the model's
  all-reduces go over it.

The groups are objects, not torch.distributed's process-global default group, so one
process may hold several engines (and a test several in turn). A peer that dies closes its
sockets: the next collective on any other rank fails at once (gloo: "Connection closed by
peer"), and a stuck one fails after `timeout_s`; both raise `EngineDeadError` here.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agentrt.engine.errors import EngineDeadError
from agentrt.engine.records import ModelInput

# Message kinds: a step (and its KV connector metadata), shutdown, the KV connector to start,
# a KV connector's metadata outside a step.
STEP, _SHUTDOWN, KV_SETUP, KV = 1, 2, 3, 4
_HEADER = 5  # (kind, T tokens, R requests, max blocks per request, KV metadata bytes)
_IDLE_WAIT = datetime.timedelta(days=365)  # a worker waiting for the engine's next step


def connect_store(
    rank: int, world_size: int, host: str, port: int, timeout_s: float
) -> dist.TCPStore:
    """Rank 0 hosts the store (`port=0`: any free port; read it back from `store.port`);
    the others connect to it, retrying until `timeout_s`. A store on a loopback `host` listens
    on loopback only (TCPStore alone would listen on every interface); one at a rendezvous
    address (MASTER_ADDR) listens where torch puts it, for the other machines."""
    listen_fd = None
    if rank == 0 and ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        listener = socket.create_server((host, port), backlog=max(64, world_size))
        port = listener.getsockname()[1]
        listen_fd = listener.detach()  # the store owns the socket from here
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


@dataclass(frozen=True, slots=True)
class WorkerMessage:
    """What a worker receives: `kind` (STEP: `inp` is set; KV_SETUP, KV: only `kv`), and
    the KV connector's bytes (empty: none)."""

    kind: int
    inp: ModelInput | None
    kv: bytes


class TensorParallelGroup:
    """This rank's view of the tensor-parallel group. Rank 0 calls `send_step` before each
    forward and `send_shutdown` once; workers loop on `receive_step`. Every rank calls
    `all_reduce` at the same points of the forward. Not thread-safe."""

    def __init__(
        self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
    ) -> None:
        """Joins the groups: a collective rendezvous that blocks until all ranks call it."""
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.closed = False
        # The model's KV cache groups (core/kv_cache_groups.py), which each step's input
        # carries tables of: the model runner sets it.
        self.num_kv_groups = 1
        self.control = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank, size, self.timeout
        )
        self.device_group = self.control
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            torch.cuda.set_device(device)
            self.device_group = dist.ProcessGroupNCCL(
                dist.PrefixStore("device", store), rank, size, options
            )

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place (every rank gets the sum)."""
        try:
            self.device_group.allreduce([tensor]).wait()
        except RuntimeError as exc:
            raise self._dead(exc) from exc

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of every rank's `values` (on the control group)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        options.timeout = self.timeout
        try:
            self.control.allreduce([tensor], options).wait()
        except RuntimeError as exc:
            raise self._dead(exc) from exc
        return tensor.tolist()

    # -- rank 0 ----------------------------------------------------------------------------

    def send_step(self, inp: ModelInput, kv: bytes = b"") -> None:
        """Broadcast one step's model input to the workers (which then run the same forward),
        with the KV connector's metadata for their worker sides. Sampling rows
        (`logits_indices`) stay on rank 0: only it computes logits."""
        num_tokens, num_blocks = inp.input_ids.shape[0], inp.block_tables.shape[1]
        self._send_header(STEP, [num_tokens, len(inp.query_lens), num_blocks], kv)
        payload = torch.cat(
            [
                inp.input_ids,
                inp.positions,
                inp.slot_mapping,
                inp.query_start_loc.long(),
                inp.seq_lens.long(),
                inp.block_tables.long().view(-1),
                *inp.group_slot_mappings,
                *(tables.long().view(-1) for tables in inp.group_block_tables),
            ]
        )
        self._broadcast(self.device_group, payload)

    def send_kv_setup(self, data: bytes) -> None:
        """Tell the workers to start their worker side of a KV connector."""
        self._send_header(KV_SETUP, [0, 0, 0], data)

    def send_kv(self, kv: bytes) -> None:
        """The KV connector's metadata outside a step; the workers then report their loads
        (`all_reduce_min`) if any are in flight."""
        self._send_header(KV, [0, 0, 0], kv)

    def send_shutdown(self) -> None:
        """Tell the workers to leave their loop; later calls do nothing."""
        if self.closed:
            return
        self.closed = True
        self._broadcast(self.control, torch.tensor([_SHUTDOWN, 0, 0, 0, 0]))

    def _send_header(self, kind: int, sizes: list[int], kv: bytes) -> None:
        if self.closed:
            raise EngineDeadError(
                "the tensor-parallel group is closed (shut down, or a rank died): start a "
                "new engine."
            )
        self._broadcast(self.control, torch.tensor([kind, *sizes, len(kv)]))
        if kv:
            self._broadcast(self.control, torch.frombuffer(bytearray(kv), dtype=torch.uint8))

    # -- workers ---------------------------------------------------------------------------

    def receive(self) -> WorkerMessage | None:
        """Wait (without a time limit) for rank 0's next message; None when it shuts down."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        self._broadcast(self.control, header, _IDLE_WAIT)
        kind, num_tokens, num_requests, num_blocks, num_kv_bytes = header.tolist()
        if kind == _SHUTDOWN:
            self.closed = True
            return None
        kv = b""
        if num_kv_bytes:
            data = torch.empty(num_kv_bytes, dtype=torch.uint8)
            self._broadcast(self.control, data)
            kv = data.numpy().tobytes()
        if kind != STEP:
            return WorkerMessage(kind, None, kv)
        return WorkerMessage(STEP, self._receive_input(num_tokens, num_requests, num_blocks), kv)

    def _receive_input(self, num_tokens: int, num_requests: int, num_blocks: int) -> ModelInput:
        num_more = self.num_kv_groups - 1  # KV cache groups after the first
        sizes = [num_tokens] * 3 + [num_requests + 1, num_requests, num_requests * num_blocks]
        sizes += [num_tokens] * num_more + [num_requests * num_blocks] * num_more
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        self._broadcast(self.device_group, payload)
        parts = payload.split(sizes)
        input_ids, positions, slot_mapping, cu, seq_lens, tables = parts[:6]
        group_tables = [t.view(num_requests, num_blocks).int() for t in parts[6 + num_more :]]
        seq_lens_host = seq_lens.tolist()
        query_lens = torch.diff(cu).tolist()
        return ModelInput(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=cu.int(),
            seq_lens=seq_lens.int(),
            block_tables=tables.view(num_requests, num_blocks).int(),
            logits_indices=payload.new_empty(0),
            query_lens=query_lens,
            context_lens=[s - q for s, q in zip(seq_lens_host, query_lens, strict=True)],
            max_seq_len=max(seq_lens_host),
            group_slot_mappings=list(parts[6 : 6 + num_more]),
            group_block_tables=group_tables,
        )

    # --------------------------------------------------------------------------------------

    def _broadcast(
        self, group, tensor: torch.Tensor, timeout: datetime.timedelta | None = None
    ) -> None:
        try:
            group.broadcast(tensor, 0, timeout or self.timeout).wait()
        except RuntimeError as exc:
            raise self._dead(exc) from exc

    def _dead(self, exc: RuntimeError) -> EngineDeadError:
        self.closed = True
        return EngineDeadError(
            f"tensor-parallel rank {self.rank} of {self.size} lost its peers ({exc}). A rank "
            "exited or stopped answering: see that rank's log, then start a new engine."
        )
