"""KV connectors under attack (DESIGN.md, Security), on a tiny random model in fp32 and real
sockets on 127.0.0.1.

An attacker holds what any client holds: the public request fields, and the
`kv_transfer_params` a producer hands out. Each test asserts that nothing was loaded, freed,
or leaked, and that legitimate transfers still complete with one instance's greedy tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import stat

import pytest
import zmq
from safetensors import safe_open
from safetensors.torch import save_file

from agentrt.engine.client.llm import LLM
from agentrt.engine.core.block_hash import extend_block_hashes
from agentrt.engine.errors import ConfigError, ErrorCode, InvalidRequestError
from agentrt.engine.kv_transfer.auth import KVAuthError, ParamsSigner, canonical, derive_key, mac
from agentrt.engine.kv_transfer.p2p_worker import curve_server_keys
from agentrt.engine.kv_transfer.storage import KEY_FILE, storage_secret
from agentrt.engine.sampling_params import SamplingParams

SECRET = "the-instances-shared-secret"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
REMOTE_DECODE = SamplingParams(
    temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
)
BS = 16


def prompt(seed: int, num_tokens: int = 3 * BS + 5) -> list[int]:
    """A prompt of its own: three full blocks to transfer, and a few tokens."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(num_tokens)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


def engine(model: str, **options) -> LLM:
    return LLM(model, dtype="float32", num_kv_blocks=64, **options)


def p2p(model: str, role: str, **options) -> LLM:
    return engine(model, kv_connector="p2p", kv_role=role, kv_secret=SECRET, **options)


@pytest.fixture(scope="module")
def solo(model) -> LLM:
    return engine(model, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def producer(model) -> LLM:
    return p2p(model, "producer")


@pytest.fixture(scope="module")
def consumer(model) -> LLM:
    return p2p(model, "consumer", kv_transfer_timeout_s=1.0)


def tokens(llm: LLM, token_ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate([token_ids], params)[0].outputs[0].token_ids


def prefill(producer: LLM, token_ids: list[int]) -> dict:
    kv = producer.generate([token_ids], REMOTE_DECODE)[0].kv_transfer_params
    assert kv is not None and kv["do_remote_prefill"]
    return kv


def with_kv(kv: dict) -> SamplingParams:
    return dataclasses.replace(GREEDY, kv_transfer_params=kv)


def loaded_tokens(llm: LLM) -> int:
    return llm.engine.stats().kv_transfer.num_loaded_tokens


def decodes_remotely(consumer: LLM, solo: LLM, token_ids: list[int], kv: dict) -> None:
    """A legitimate transfer: the consumer loads the prefill and decodes one instance's
    greedy tokens."""
    before = loaded_tokens(consumer)
    assert tokens(consumer, token_ids, with_kv(kv)) == tokens(solo, token_ids)
    assert loaded_tokens(consumer) - before == kv["remote_num_tokens"]
    consumer.engine.kv_manager.check_invariants()


def held(producer: LLM) -> set[str]:
    return set(producer.engine.connector.held)


# -- params from a client ---------------------------------------------------------------------


@pytest.fixture
def listener():
    """A TCP port of the test's own on 127.0.0.1, counting the connections it gets."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)

    def num_connections() -> int:
        count = 0
        while True:
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    yield sock.getsockname()[1], num_connections
    sock.close()


def test_altered_or_forged_params_are_refused_and_nothing_is_contacted(
    producer, consumer, solo, listener
):
    port, num_connections = listener
    token_ids = prompt(1)
    kv = prefill(producer, token_ids)
    altered = {**kv, "remote_port": port}
    forged = ParamsSigner("a secret of the attacker").sign(
        {k: v for k, v in altered.items() if k not in ("signature", "expires")}, 60
    )
    unsigned = {k: v for k, v in altered.items() if k not in ("signature", "expires")}
    for params in (altered, forged, unsigned, {**kv, "remote_key": "0" * 64}):
        with pytest.raises(InvalidRequestError, match="not signed") as raised:
            consumer.generate([token_ids], with_kv(params))
        assert raised.value.field == "kv_transfer_params"
    # Past the front end's check (a request queued on the engine directly), the connector
    # checks again: it computes the prefill itself and contacts nobody.
    core = consumer.engine
    request = core.processor.process("direct", token_ids, with_kv(kv))
    altered_params = dataclasses.replace(request.sampling_params, kv_transfer_params=altered)
    request = dataclasses.replace(request, sampling_params=altered_params)
    before = core.stats().kv_transfer
    core.add_request(request, None)
    out = {}
    while core.has_unfinished_requests():
        out.update((d.request_id, d.output) for d in core.step() if d.finished)
    assert out["direct"].outputs[0].token_ids == tokens(solo, token_ids)
    after = core.stats().kv_transfer
    assert after.num_load_failures == before.num_load_failures + 1
    assert after.num_loaded_tokens == before.num_loaded_tokens
    assert num_connections() == 0
    # The producer still holds the blocks for the real consumer, who gets them.
    assert kv["remote_request_id"] in held(producer)
    consumer.engine.reset_prefix_cache()
    decodes_remotely(consumer, solo, token_ids, kv)


def test_kv_transfer_params_need_a_p2p_connector(solo):
    with pytest.raises(InvalidRequestError, match="runs no p2p KV connector"):
        solo.generate([prompt(2)], REMOTE_DECODE)


def test_a_consumer_fetches_only_from_allowed_producers(model, producer, solo):
    token_ids = prompt(3)
    kv = prefill(producer, token_ids)
    strict = p2p(model, "consumer", kv_allowed_producers="127.0.0.1:1")
    before = strict.engine.stats().kv_transfer.num_load_failures
    assert tokens(strict, token_ids, with_kv(kv)) == tokens(solo, token_ids)
    assert strict.engine.stats().kv_transfer.num_load_failures == before + 1
    assert loaded_tokens(strict) == 0
    strict.engine.shutdown()


# -- the producer's socket --------------------------------------------------------------------


def exchange(
    port: int, frames: list[bytes], timeout_ms: int = 2000, *, curve: str | None = SECRET
) -> list[bytes] | None:
    """Send `frames` from a fresh DEALER; the answer, or None after `timeout_ms`. `curve`:
    the secret the peer derives the producer's CURVE key from (None: a plain socket)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = curve_server_keys(curve)[0]
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(frames)
        return sock.recv_multipart() if sock.poll(timeout_ms) else None
    finally:
        sock.close()


def ask(kv: dict, secret: str | None, **changes) -> bytes:
    """An ask for the blocks `kv` names, with a MAC under `secret`'s wire key (None: none)."""
    fields = {
        "req_id": kv["remote_request_id"],
        "block_ids": kv["remote_block_ids"],
        "engine_id": kv["remote_engine_id"],
        "key": kv["remote_key"],
        "nonce": "00" * 16,
        **changes,
    }
    if secret is not None:
        fields["mac"] = mac(derive_key(secret, "wire"), b"ask", canonical(fields))
    return json.dumps(fields).encode()


def refused(answer: list[bytes] | None) -> bool:
    """An answer that carries no KV bytes."""
    return (
        answer is not None
        and len(answer) == 2
        and not json.loads(answer[0])["ok"]
        and not answer[1]
    )


def test_a_peer_without_the_secret_gets_no_kv_and_frees_nothing(producer, consumer, solo):
    token_ids = prompt(4)
    kv = prefill(producer, token_ids)
    port = kv["remote_port"]
    sent_before = producer.engine.stats().kv_transfer.num_saved_blocks
    guessed = [kv["remote_request_id"], *(f"llm-{i}" for i in range(5))]
    for req_id in guessed:
        # Without the secret the CURVE handshake fails: not even an answer comes back.
        for curve in (None, "a guessed secret, wrong but long enough"):
            assert exchange(port, [ask(kv, curve, req_id=req_id)], 150, curve=curve) is None
        # Past the handshake (the secret's CURVE key), an ask without a valid MAC is refused.
        for secret in (None, "a guessed secret, wrong but long enough"):
            assert refused(exchange(port, [ask(kv, secret, req_id=req_id)]))
    assert kv["remote_request_id"] in held(producer)
    assert producer.engine.stats().kv_transfer.num_saved_blocks == sent_before
    decodes_remotely(consumer, solo, token_ids, kv)


def test_an_authenticated_ask_must_match_the_held_request(producer, consumer, solo):
    token_ids = prompt(5)
    kv = prefill(producer, token_ids)
    port = kv["remote_port"]
    other = prefill(producer, prompt(6))
    wrong = [
        {"key": other["remote_key"]},  # another prompt's tokens
        {"block_ids": other["remote_block_ids"]},  # another request's blocks
        {"block_ids": "all"},
        {"engine_id": "another model"},
        {"req_id": other["remote_request_id"]},  # a request with another key
    ]
    for changes in wrong:
        assert refused(exchange(port, [ask(kv, SECRET, **changes)]))
    assert {kv["remote_request_id"], other["remote_request_id"]} <= held(producer)
    decodes_remotely(consumer, solo, token_ids, kv)
    # Once sent, the blocks are gone: asking again (a replay) gets nothing.
    assert refused(exchange(port, [ask(kv, SECRET)]))


def test_malformed_and_oversized_messages_do_not_stop_the_server(producer, consumer, solo):
    token_ids = prompt(7)
    kv = prefill(producer, token_ids)
    port = kv["remote_port"]
    rng = random.Random(0)
    garbage = [
        [b"one", b"two", b"three"],  # the message that used to kill the serving thread
        [b""],
        [b"not json"],
        [b"[1, 2, 3]"],
        [b'{"mac": 5}'],
        [ask(kv, SECRET, block_ids=[[1]])],
        [ask(kv, SECRET, req_id=None)],
        [b"{" * 100_000],
    ]
    garbage += [[rng.randbytes(rng.randrange(1, 300))] for _ in range(30)]
    garbage += [[rng.randbytes(20) for _ in range(rng.randrange(2, 5))] for _ in range(10)]
    for frames in garbage:  # from a peer past the CURVE handshake, and from one without it
        answer = exchange(port, frames, timeout_ms=300)
        assert answer is None or refused(answer)
        assert exchange(port, frames, timeout_ms=50, curve=None) is None
    # Larger than MAXMSGSIZE: ZMQ drops the peer, nothing is answered.
    assert exchange(port, [b"x" * (2 << 20)], timeout_ms=300) is None
    assert producer.engine.runner.connector._server.is_alive()
    assert kv["remote_request_id"] in held(producer)
    decodes_remotely(consumer, solo, token_ids, kv)
    again = prompt(8)
    decodes_remotely(consumer, solo, again, prefill(producer, again))


# -- holds --------------------------------------------------------------------------------------


def test_a_flood_of_holds_pins_at_most_the_cap(model, consumer, solo):
    capped = p2p(model, "producer", kv_max_held_fraction=0.25)  # 16 of its 64 blocks
    max_held = 16
    # 4 blocks each (prompt and sampled token): 4 fit under the cap; the others are refused
    # at admission (OVERLOADED: the server's 429), all in one batch and one at a time.
    outputs = capped.generate([prompt(100 + seed) for seed in range(6)], REMOTE_DECODE)
    outputs += [capped.generate([prompt(106 + seed)], REMOTE_DECODE)[0] for seed in range(4)]
    core = capped.engine
    num_held = sum(len(core.kv_manager.block_ids(r)) for r in core.connector.held)
    assert num_held == max_held
    kept = [o.kv_transfer_params for o in outputs if o.outputs[0].finish_reason != "error"]
    refused = [o for o in outputs if o.outputs[0].finish_reason == "error"]
    assert len(kept) == 4 and all(kv["do_remote_prefill"] for kv in kept)
    assert len(refused) == 6
    assert {o.error_code for o in refused} == {ErrorCode.OVERLOADED}
    assert "kv_max_held_fraction" in refused[0].error and refused[0].kv_transfer_params is None
    assert capped.engine.stats().kv_transfer.num_holds_refused == 6
    # One that could never fit under the cap is not told to retry.
    huge = dataclasses.replace(REMOTE_DECODE, max_tokens=16 * BS)
    never = capped.generate([prompt(150)], huge)[0]
    assert never.error_code == ErrorCode.INVALID_REQUEST and "at all" in never.error
    # Other requests still run, and a held prefill still decodes remotely.
    assert tokens(capped, prompt(200)) == tokens(solo, prompt(200))
    decodes_remotely(consumer, solo, prompt(100), kept[0])
    # A fetched hold gives its room back: the next do_remote_decode is held again.
    assert capped.generate([prompt(300)], REMOTE_DECODE)[0].kv_transfer_params["do_remote_prefill"]
    core.kv_manager.check_invariants()
    capped.engine.shutdown()


# -- storage ------------------------------------------------------------------------------------


def storage(model: str, path, **options) -> LLM:
    return engine(model, kv_connector="storage", kv_storage_path=str(path), **options)


def test_stored_files_are_private_and_hold_no_tokens(model, tmp_path):
    llm = storage(model, tmp_path)
    token_ids = prompt(9)
    llm.generate([token_ids], GREEDY)
    llm.engine.shutdown()
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    for path in [tmp_path / KEY_FILE, *files]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for folder in {f.parent for f in files} | {f.parent.parent for f in files}:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for path in files:
        with safe_open(path, framework="pt") as f:
            assert set(f.metadata()) == {"mac"}  # no token ids in the clear
        assert path.stem not in {h.hex() for h in extend_block_hashes([], token_ids, BS)}


def test_a_key_file_others_could_read_or_replace_is_refused(tmp_path):
    secret = storage_secret(tmp_path)
    assert storage_secret(tmp_path) == secret and len(secret) == 64  # made once, then read
    key = tmp_path / KEY_FILE
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        storage_secret(tmp_path)
    key.unlink()
    planted = tmp_path / "planted"
    planted.write_text("a secret the attacker knows")
    planted.chmod(0o600)
    key.symlink_to(planted)
    with pytest.raises(ConfigError, match="is a link"):
        storage_secret(tmp_path)


@pytest.mark.parametrize("attack", ["swap", "alter", "unsigned", "foreign secret"])
def test_a_planted_or_altered_file_is_refused_and_recomputed(model, tmp_path, solo, attack):
    victim, planted = prompt(10), prompt(11)
    writer = storage(model, tmp_path, kv_secret=SECRET)
    writer.generate([victim, planted], GREEDY)
    writer.engine.shutdown()
    connector = writer.engine.connector
    target = connector.path(extend_block_hashes([], victim, BS)[0])  # the victim's first block
    source = connector.path(extend_block_hashes([], planted, BS)[0])
    with safe_open(target, framework="pt") as f:
        kv, metadata = f.get_tensor("kv"), f.metadata()
    if attack == "swap":  # another prompt's genuine, signed block under the victim's name
        target.write_bytes(source.read_bytes())
    elif attack == "alter":  # the KV changed, the MAC kept
        save_file({"kv": kv + 1}, target, metadata=metadata)
    elif attack == "unsigned":
        save_file({"kv": kv + 1}, target)
    else:  # signed by whoever wrote it with another secret
        other = tmp_path / "other"
        planter = storage(model, other, kv_secret="the attacker's own secret, not the instances'")
        planter.generate([victim], GREEDY)
        planter.engine.shutdown()
        planted_file = planter.engine.connector.path(extend_block_hashes([], victim, BS)[0])
        target.write_bytes(planted_file.read_bytes())
    planted_bytes = target.read_bytes()

    reader = storage(model, tmp_path, kv_secret=SECRET, enable_prefix_caching=False)
    assert tokens(reader, victim) == tokens(solo, victim)
    stats = reader.engine.stats().kv_transfer
    assert stats.num_load_failures == 1 and stats.num_loaded_tokens == 0
    reader.engine.shutdown()
    assert target.read_bytes() != planted_bytes  # replaced by the recomputed block


def test_the_storage_cap_evicts_the_least_recently_used_blocks(model, tmp_path, solo):
    llm = storage(model, tmp_path)
    llm.generate([prompt(12)], GREEDY)
    llm.engine.shutdown()
    file_bytes = next(tmp_path.rglob("*.safetensors")).stat().st_size
    cap_gb = 5.5 * file_bytes / 2**30  # room for five blocks
    capped = storage(model, tmp_path, kv_storage_max_gb=cap_gb)
    for seed in range(13, 17):
        capped.generate([prompt(seed)], GREEDY)
    capped.engine.shutdown()
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 5
    assert sum(f.stat().st_size for f in files) <= cap_gb * 2**30
    last = prompt(16)
    newest = {capped.engine.connector.path(h) for h in extend_block_hashes([], last, BS)}
    assert newest <= set(files)  # the last prompt's blocks stayed
    # A new instance under the cap loads what stayed.
    reader = storage(model, tmp_path, kv_storage_max_gb=cap_gb, enable_prefix_caching=False)
    assert tokens(reader, last) == tokens(solo, last)
    assert loaded_tokens(reader) == 3 * BS
    reader.engine.shutdown()


def _wait_released(producer: LLM, req_id: str) -> None:
    """Step the producer until its engine freed the hold (it frees sent holds each step)."""
    import time

    deadline = time.monotonic() + 10
    while req_id in held(producer):
        assert time.monotonic() < deadline, "the hold was not released"
        producer.generate([prompt(999)], dataclasses.replace(GREEDY, max_tokens=1))


def test_a_front_end_releases_the_hold_of_a_decode_that_cannot_run(producer, listener):
    # A decode instance that refuses a request before its engine sees it (too long for it,
    # its queue full) used to leave the producer's blocks pinned for the hold timeout.
    from agentrt.engine.kv_transfer.p2p_worker import release_hold

    kv = prefill(producer, prompt(41))
    assert kv["remote_request_id"] in held(producer)
    assert release_hold(kv, SECRET, 5.0)
    _wait_released(producer, kv["remote_request_id"])
    assert not release_hold(kv, SECRET, 5.0)  # released once: nothing left to free
    # Params a client altered are refused before anything is contacted.
    port, num_connections = listener
    with pytest.raises(KVAuthError):
        release_hold({**prefill(producer, prompt(42)), "remote_port": port}, SECRET, 1.0)
    assert num_connections() == 0


def test_the_server_releases_the_hold_when_the_decode_is_refused(producer):
    import types

    from agentrt.server.errors import APIError
    from agentrt.server.generation import Generation
    from agentrt.server.metrics import ServerMetrics

    kv = prefill(producer, prompt(43))

    class RefusingEngine:  # a decode instance's front end that refuses the request
        config = types.SimpleNamespace(kv_transfer=producer.engine.config.kv_transfer)

        def add_request(self, *args, **kwargs):
            raise InvalidRequestError("too long for this instance", field="prompt")

        def abort(self, request_id):
            pass

    with pytest.raises(APIError):
        Generation(RefusingEngine(), ServerMetrics("m"), [prompt(43)], [with_kv(kv)])
    _wait_released(producer, kv["remote_request_id"])
