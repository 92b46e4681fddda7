"""The full refit protocol across real processes: shm buffers, ZMQ ipc:// sockets, spawn.

Two producers with different tensor sets/orders (like PP stages / EP ranks) each stream to the
consumer "on their GPU"; each consumer checks every tensor bit for bit. Fault cases: swapped
metadata, the legacy rank-0-metadata mode, a dead consumer, a leaking load_weights, an exporter
that skips a tensor. Processes come from one spawn pool per module (torch import is the cost).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import uuid
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.refit import harness as H

CTX = mp.get_context("spawn")


@pytest.fixture(scope="module")
def shared():
    return {"seq": CTX.Value("q", 0), "log": CTX.Queue(), "gate": CTX.Event()}


@pytest.fixture(scope="module")
def pool(shared):
    ex = ProcessPoolExecutor(
        max_workers=4,
        mp_context=CTX,
        initializer=H.init_worker,
        initargs=(shared["seq"], shared["log"], shared["gate"]),
    )
    yield ex
    ex.shutdown(wait=False, cancel_futures=True)  # idle workers exit on their own


def _session() -> str:
    return uuid.uuid4().hex[:10]


def _run(pool, producers: list[dict], consumers: list[dict], timeout: float = 60) -> tuple[list[dict], list[dict]]:
    futs_c = [pool.submit(H.consumer_main, c) for c in consumers]
    futs_p = [pool.submit(H.producer_main, p) for p in producers]
    return [f.result(timeout) for f in futs_p], [f.result(timeout) for f in futs_c]


def _drain(log, until: set | None = None, timeout: float = 10.0) -> list[tuple]:
    """Event-log entries ``(seq, side, rank, event, index)``; waits until the ``until`` keys are in."""
    out: list[tuple] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            out.append(log.get(timeout=0.05))
            continue
        except queue.Empty:
            pass
        have = {(side, ev, i) for _n, side, _r, ev, i in out}
        if not until or until <= have or time.monotonic() > deadline:
            return sorted(out)


def test_two_producers_with_different_layouts_two_refits(pool, shared):
    s = _session()
    prods, cons = _run(
        pool,
        [{"session": s, "rank": r, "steps": 2} for r in (0, 1)],
        [{"session": s, "device": r, "steps": 2} for r in (0, 1)],
    )
    _drain(shared["log"])
    for rank, (p, c) in enumerate(zip(prods, cons)):
        H.ok(p), H.ok(c)
        specs = H.rank_specs(rank)
        assert c["mismatches"] == []  # every tensor bit-identical to what its own producer exported
        assert c["loaded"] == [sorted(x.name for x in specs)] * 2  # exactly its rank's tensors, both refits
        assert c["dtypes"][f"model.layers.{rank}.mlp.gate.e_score_correction_bias"] == "float32"  # SkyRL #1816
        assert c["dtypes"]["model.norm.weight" if rank else "model.embed_tokens.weight"] == "bfloat16"
        for m, cm in zip(p["metrics"], c["metrics"]):
            assert m["num_tensors"] == len(specs) == cm["num_tensors"]
            assert m["bytes"] == cm["bytes"] > 0 and m["num_buckets"] == cm["num_buckets"] >= 3
            assert m["gbps"] > 0 and m["seconds"] > 0 and m["fp32_tensors"] == 1
            assert m["fixes"]["per_rank_ipc_metadata"] is True and m["fixes"]["sleep_level"] == 2
            assert m["consumer"]["bytes"] == m["bytes"] and m["half_bytes"] == 8192
        assert [m["refit_id"] for m in p["metrics"]] == [1, 2]
        assert p["held_previous"] == []  # the producer drops each exported tensor before asking for the next
    # rank 1 exports an 8-KiB-half-busting fused expert tensor -> exactly one one-off bucket
    assert prods[1]["metrics"][0]["num_oneoff_buckets"] == 1
    assert prods[1]["metrics"][0]["peak_buffer_bytes"] == 2 * 8192 + 32768
    assert prods[0]["metrics"][0]["num_oneoff_buckets"] == 0
    if prods[0]["metrics"][0]["bytes"] == prods[1]["metrics"][0]["bytes"]:
        pytest.fail("the two synthetic ranks must differ in size for this test to mean anything")


def test_swapped_metadata_between_ranks_is_caught_by_the_manifest(pool, shared):
    s = _session()
    prods, cons = _run(
        pool,
        [{"session": s, "rank": r, "metadata_source_rank": 1 - r, "metadata_subscribers": 1} for r in (0, 1)],
        [{"session": s, "device": r} for r in (0, 1)],
    )
    _drain(shared["log"])
    for rank, (p, c) in enumerate(zip(prods, cons)):
        assert not c["ok"] and c["error_type"] == "RefitManifestError", c
        assert f"from producer rank {1 - rank}" in c["error"] and "per_rank_ipc_metadata" in c["error"]
        assert c["loaded"] == []  # caught before a single tensor was loaded under a wrong name
        assert not p["ok"] and p["error_type"] == "RefitRemoteError" and "RefitManifestError" not in p["error_type"]
        assert f"from producer rank {1 - rank}" in p["error"]  # the consumer's reason reaches the trainer log


def test_legacy_rank0_metadata_mode_is_caught(pool, shared):
    """``per_rank_ipc_metadata=False`` reproduces SkyRL #1816 (rank 0's metadata everywhere)."""
    s = _session()
    cfg = {"per_rank_ipc_metadata": False}
    prods, cons = _run(
        pool,
        [{"session": s, "rank": r, "cfg": cfg} for r in (0, 1)],
        [{"session": s, "device": r} for r in (0, 1)],
    )
    _drain(shared["log"])
    H.ok(prods[0]), H.ok(cons[0])  # rank 0 slices its own buffer with its own metadata: fine
    assert prods[0]["metrics"][0]["fixes"]["per_rank_ipc_metadata"] is True
    assert not cons[1]["ok"] and cons[1]["error_type"] == "RefitManifestError"
    assert "from producer rank 0" in cons[1]["error"]
    assert not prods[1]["ok"] and prods[1]["error_type"] == "RefitRemoteError"


def test_ping_pong_packs_next_bucket_before_previous_ack(pool, shared):
    shared["gate"].clear()
    _drain(shared["log"])
    s = _session()
    prods, cons = _run(
        pool, [{"session": s, "rank": 0, "world_size": 1}], [{"session": s, "device": 0, "gate_first_bucket": True}]
    )
    H.ok(prods[0]), H.ok(cons[0])
    assert cons[0]["gate_opened"] is True  # load of bucket 0 was held until the producer packed bucket 1
    keys = {
        ("producer", "pack_start", 1),
        ("producer", "pack_start", 2),
        ("producer", "ack", 0),
        ("producer", "send", 0),
    }
    keys |= {("consumer", "ack", 0), ("consumer", "recv", 0), ("consumer", "load_end", 0)}
    events = _drain(shared["log"], until=keys)
    seq = {(side, ev, i): n for n, side, _rank, ev, i in events}
    assert seq[("producer", "pack_start", 1)] < seq[("consumer", "ack", 0)] < seq[("producer", "ack", 0)]
    assert seq[("producer", "send", 0)] < seq[("consumer", "recv", 0)]
    # half 0 is reused by bucket 2 only after bucket 0's ack arrived
    assert seq[("producer", "ack", 0)] < seq[("producer", "pack_start", 2)]
    assert seq[("consumer", "load_end", 0)] < seq[("consumer", "ack", 0)]


@pytest.mark.parametrize("last", [None, "model.layers.1.mlp.experts.gate_up_proj"], ids=["half", "oneoff"])
def test_end_is_sent_right_behind_the_last_bucket_before_its_ack(pool, shared, last):
    """The producer sends End right after the last bucket and only then collects the acks still owed and Done:
    the consumer holds its last bucket's load until the producer has sent End (a producer that waited for that
    bucket's ack before sending End would never get there). A one-off buffer as the last bucket is still freed
    only once its ack is read, before Done."""
    shared["gate"].clear()
    _drain(shared["log"])
    s = _session()
    rank = 1 if last else 0
    specs = H.rank_specs(rank)
    producer = {"session": s, "rank": rank, "world_size": 1, "gate_on": ("end", None), "last": last}
    consumer = {"session": s, "device": rank, "gate_on_tensor": last or specs[-1].name}
    prods, cons = _run(pool, [producer], [consumer])
    p, c = H.ok(prods[0]), H.ok(cons[0])
    assert c["gate_opened"] is True  # the last bucket's load waited for End, so End went out before its ack
    assert c["mismatches"] == [] and c["loaded"] == [sorted(x.name for x in specs)]
    m, cm = p["metrics"][0], c["metrics"][0]
    assert m["num_buckets"] == cm["num_buckets"] >= 3 and m["num_tensors"] == cm["num_tensors"] == len(specs)
    assert m["buffers_kept"] == cm["buffers_kept"] == 2  # End's kept slots: the two halves, on both sides
    n = m["num_buckets"] - 1  # the last bucket
    keys = {("producer", "send", n), ("producer", "end", n), ("producer", "ack", n), ("producer", "done", n),
            ("consumer", "load_end", n), ("consumer", "ack", n)}
    if last:
        keys.add(("producer", "free_oneoff", n))
    events = [e for e in _drain(shared["log"], until=keys) if e[2] == rank]
    seq = {(side, ev, i): num for num, side, _r, ev, i in events}
    assert seq[("producer", "send", n)] < seq[("producer", "end", n)] < seq[("consumer", "load_end", n)]
    assert seq[("producer", "end", n)] < seq[("producer", "ack", n)] < seq[("producer", "done", n)]
    assert seq[("consumer", "ack", n)] < seq[("producer", "ack", n)]
    # every ack is still read, in order, before Done
    assert [i for _n, side, _r, ev, i in events if (side, ev) == ("producer", "ack")] == list(range(n + 1))
    freed = [(num, i) for num, side, _r, ev, i in events if (side, ev) == ("producer", "free_oneoff")]
    if last:
        assert m["num_oneoff_buckets"] == 1 and [i for _num, i in freed] == [n]  # the last bucket is the one-off
        # freed only after the consumer acked it (and the producer read the ack), and before send() returned
        assert seq[("consumer", "ack", n)] < seq[("producer", "ack", n)] < freed[0][0] < seq[("producer", "done", n)]
    else:
        assert m["num_oneoff_buckets"] == 0 and freed == []
    assert p["shm_left_after_close"] == []


def test_load_weights_keeping_views_is_a_leak_error(pool, shared):
    s = _session()
    prods, cons = _run(
        pool, [{"session": s, "rank": 0, "world_size": 1}], [{"session": s, "device": 0, "keep_views": True}]
    )
    _drain(shared["log"])
    assert not cons[0]["ok"] and cons[0]["error_type"] == "RefitLeakError"
    assert "model.embed_tokens.weight" in cons[0]["error"] and "must" in cons[0]["error"]
    assert not prods[0]["ok"] and "RefitLeakError" not in prods[0]["error_type"]


def test_exporter_skipping_a_tensor_fails_on_both_sides(pool, shared):
    s = _session()
    prods, cons = _run(
        pool, [{"session": s, "rank": 1, "world_size": 1, "drop_last": True}], [{"session": s, "device": 1}]
    )
    _drain(shared["log"])
    assert not prods[0]["ok"] and "without yielding 1 announced tensor(s): 'lm_head.weight'" in prods[0]["error"]
    assert not cons[0]["ok"] and cons[0]["error_type"] == "RefitRemoteError" and "lm_head.weight" in cons[0]["error"], (
        cons[0]
    )


def test_plan_error_reaches_the_consumer_before_any_transfer(pool, shared):
    s = _session()
    prods, cons = _run(
        pool, [{"session": s, "rank": 1, "world_size": 1, "free_bytes": 40000}], [{"session": s, "device": 1}]
    )
    _drain(shared["log"])
    assert not prods[0]["ok"] and prods[0]["error_type"] == "RefitPlanError"
    assert "model.layers.1.mlp.experts.gate_up_proj" in prods[0]["error"] and "refit.sleep_level" in prods[0]["error"]
    assert not cons[0]["ok"] and "RefitPlanError" not in cons[0]["error_type"] and cons[0]["loaded"] == []
    assert "gate_up_proj" in cons[0]["error"]


def test_dead_consumer_is_an_error_not_a_hang(pool):
    s = _session()
    consumer = CTX.Process(target=H.consumer_main, args=({"session": s, "device": 0, "die_in_load": True},))
    consumer.start()
    try:
        t0 = time.monotonic()
        result = pool.submit(H.producer_main, {"session": s, "rank": 0, "world_size": 1, "timeout_s": 30}).result(60)
        elapsed = time.monotonic() - t0
    finally:
        consumer.join(10)
    assert not result["ok"] and result["error_type"] == "RefitTimeoutError"
    assert "died" in result["error"] and "its consumer" in result["error"]
    assert elapsed < 25  # noticed through the pid check, well before the 30 s timeout


def test_buffers_and_handles_are_created_once_and_reused_across_refits(pool, shared):
    """Only the first refit allocates the ping-pong halves and opens their handles; later refits reuse
    both (one-off buffers for tensors larger than a half stay per refit) and stay bit-exact."""
    s = _session()
    steps = 4
    prods, cons = _run(
        pool,
        [{"session": s, "rank": r, "steps": steps} for r in (0, 1)],
        [{"session": s, "device": r, "steps": steps} for r in (0, 1)],
    )
    _drain(shared["log"])
    for rank, (p, c) in enumerate(zip(prods, cons)):
        H.ok(p), H.ok(c)
        assert c["mismatches"] == [] and len(c["loaded"]) == steps  # new values every refit, all bit-exact
        oneoffs = [m["num_oneoff_buckets"] for m in p["metrics"]]
        assert oneoffs == [rank] * steps  # rank 1's fused expert tensor busts a half every time
        allocated = [m["buffers_allocated"] for m in p["metrics"]]
        opened = [m["buffers_opened"] for m in c["metrics"]]
        assert allocated == opened == [2 + rank] + [rank] * (steps - 1), (allocated, opened)
        assert [m["consumer"]["buffers_opened"] for m in p["metrics"]] == opened
        assert [m["buffers_kept"] for m in p["metrics"]] == [m["buffers_kept"] for m in c["metrics"]] == [2] * steps
        assert p["shm_left_after_close"] == []  # kept halves are released when the producer closes


def test_buffers_are_reallocated_when_the_plan_outgrows_them_and_reused_when_they_still_fit(pool, shared):
    """Ratio sizing with less free memory at the second refit shrinks the halves (new buffers, new
    handles); at the third refit the smaller kept halves are within the budget again and are reused."""
    s = _session()
    ratio = {"buffer_memory_ratio": 0.5, "buffer_gb": None}
    free = [32768, 24576, 32768]
    prods, cons = _run(
        pool,
        [{"session": s, "rank": 0, "world_size": 1, "steps": 3, "cfg": ratio, "free_bytes_by_step": free}],
        [{"session": s, "device": 0, "steps": 3}],
    )
    _drain(shared["log"])
    p, c = H.ok(prods[0]), H.ok(cons[0])
    assert c["mismatches"] == []
    assert [m["half_bytes"] for m in p["metrics"]] == [8192, 6144, 6144]
    assert [m["buffers_allocated"] for m in p["metrics"]] == [2, 2, 0]
    assert [m["buffers_opened"] for m in c["metrics"]] == [2, 2, 0]


def test_buffers_above_the_keep_limit_are_released_after_every_refit(pool, shared):
    s = _session()
    prods, cons = _run(
        pool,
        [{"session": s, "rank": 0, "world_size": 1, "steps": 3, "keep_buffers_max_bytes": 0}],
        [{"session": s, "device": 0, "steps": 3}],
    )
    _drain(shared["log"])
    p, c = H.ok(prods[0]), H.ok(cons[0])
    assert c["mismatches"] == []
    assert [m["buffers_allocated"] for m in p["metrics"]] == [2, 2, 2]
    assert [m["buffers_opened"] for m in c["metrics"]] == [2, 2, 2]


def test_bucket_messages_round_trip_through_the_wire_encoding():
    from rlc.runtime.refit.protocol import BucketMeta, BucketMsg, BufferRef, EntryMeta, decode, encode

    meta = BucketMeta(3, 1, 0, 1, "GPU-x", 8192, [EntryMeta("a.weight", 0, [4, 8], "bfloat16", 64),
                                                   EntryMeta("b.bias", 256, [8], "float32", 32)])
    for msg in (BucketMsg(meta=meta, open=BufferRef(0, 8192, "shm", "GPU-x")), BucketMsg(meta=meta)):
        back, payload = decode(encode(msg, b"h" if msg.open else None))
        assert back == msg and payload == (b"h" if msg.open else None)


def test_a_failed_refit_after_reused_buffers_releases_them_on_both_sides(pool, shared):
    s = _session()
    prods, cons = _run(
        pool,
        [{"session": s, "rank": 1, "world_size": 1, "steps": 2, "drop_last_at_step": 1}],
        [{"session": s, "device": 1, "steps": 2}],
    )
    _drain(shared["log"])
    p, c = prods[0], cons[0]
    assert not p["ok"] and "without yielding 1 announced tensor(s): 'lm_head.weight'" in p["error"]
    assert len(p["metrics"]) == 1 and p["metrics"][0]["buffers_kept"] == 2  # refit 1 kept its halves
    assert not c["ok"] and c["error_type"] == "RefitRemoteError" and c["mismatches"] == []
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"rlc-refit-{p['pid']}-")] == []


def test_hello_and_its_ack_carry_the_device_event_handles():
    from rlc.runtime.refit.protocol import Hello, HelloAck, decode, encode

    hello = Hello(3, "s", 0, "GPU-x", "cuda_ipc", 1, [], 0, None, "bfloat16", [], pack_events=["ab" * 32] * 3)
    ack = HelloAck("GPU-x", 2, load_events=["cd" * 32] * 2)
    for msg in (hello, ack):
        assert decode(encode(msg))[0] == msg
    # a peer without device events (shared memory) announces none: buckets are ordered by the acks
    assert decode(encode(Hello(3, "s", 0, "k", "shm", 1, [], 0, None, "bfloat16", [])))[0].pack_events == []


def test_a_consumer_refuses_a_producer_announcing_the_wrong_number_of_events():
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.consumer import RefitConsumer
    from rlc.runtime.refit.errors import RefitProtocolError

    consumer = RefitConsumer(session=_session(), backend=ShmBackend("k"))
    with pytest.raises(RefitProtocolError, match="announced 2 packed events, expected 4"):
        consumer._pair_events(["ab" * 32] * 2)
    consumer._pair_events([])  # no events: ordered by the acks alone
    assert not consumer.device_ordered


@contextlib.contextmanager
def _consumer_facing_a_hand_driven_producer(tmp_path, run):
    """A real consumer running ``run(consumer)`` in a thread, facing a producer's channel the test drives message by
    message: yields ``(producer channel, session, key, failures of run)``; joins and closes both at the end."""
    import threading

    import zmq

    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.channel import Channel, bind, endpoint, new_socket
    from rlc.runtime.refit.consumer import RefitConsumer

    session, key = _session(), "dev-" + _session()
    sock = new_socket(zmq.PAIR)
    bind(sock, endpoint(session, key, socket_dir=str(tmp_path)))
    producer = Channel(sock, "test producer", 10.0)
    consumer = RefitConsumer(session=session, backend=ShmBackend(key), socket_dir=str(tmp_path), timeout_s=10.0)
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            run(consumer)
        except BaseException as exc:  # reported to the test
            failure.append(exc)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        yield producer, session, key, failure
    finally:
        thread.join(10)
        producer.close()
        consumer.close()


def test_a_consumer_refuses_device_ordering_it_did_not_pair(tmp_path):
    """A producer that says it orders the buckets with device events the consumer never answered (a consumer on a
    synchronous backend answers none) would overwrite halves the consumer still reads: the consumer refuses it."""
    from rlc.runtime.refit.errors import RefitProtocolError, RefitRemoteError
    from rlc.runtime.refit.protocol import PROTOCOL_VERSION, Begin, Hello, HelloAck

    def pair_and_receive(consumer) -> None:
        consumer.prepare()
        consumer.receive(lambda weights: None)

    with _consumer_facing_a_hand_driven_producer(tmp_path, pair_and_receive) as (producer, session, key, failure):
        producer.send(Hello(PROTOCOL_VERSION, session, 0, key, "shm", os.getpid(), [], 0, None, "bfloat16", []))
        ack, _ = producer.recv("hello_ack")
        assert isinstance(ack, HelloAck) and ack.load_events == []
        producer.send(Begin(refit_id=1, plan={}, device_ordered=True))
        with pytest.raises(RefitRemoteError, match="has not paired"):  # the consumer's error, on the wire
            producer.recv("the consumer's error")
    assert failure and isinstance(failure[0], RefitProtocolError)


def test_an_export_list_naming_a_tensor_twice_is_refused_at_pairing_and_the_producer_is_told(tmp_path):
    """The consumer checks the announced export list once, when it pairs (not at every refit's manifest), and a
    failure there reaches the producer on the wire instead of leaving it waiting for the pairing's answer."""
    from rlc.runtime.refit.errors import RefitManifestError, RefitRemoteError
    from rlc.runtime.refit.protocol import PROTOCOL_VERSION, Hello
    from rlc.runtime.refit.specs import TensorSpec, specs_to_json

    embedding = TensorSpec("model.embed_tokens.weight", (16, 8), "bfloat16")
    with _consumer_facing_a_hand_driven_producer(tmp_path, lambda c: c.prepare()) as (producer, session, key, failure):
        twice = specs_to_json([embedding, embedding])
        producer.send(Hello(PROTOCOL_VERSION, session, 0, key, "shm", os.getpid(), twice, 0, None, "bfloat16", []))
        with pytest.raises(RefitRemoteError, match="duplicate names"):  # at once, not after the pairing timeout
            producer.recv("the consumer's hello_ack", timeout_s=5.0)
    assert failure and isinstance(failure[0], RefitManifestError)
