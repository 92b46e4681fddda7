"""The refit's control channel: a message already queued is read, and a socket with room is written, without a poll
first (a refit sends a dozen small messages on its critical path); a full or silent peer still times out cleanly."""
from __future__ import annotations

import dataclasses
import uuid

import pytest
import zmq

from rlc.runtime.refit.channel import Channel
from rlc.runtime.refit.errors import RefitRemoteError, RefitTimeoutError
from rlc.runtime.refit.metrics import ConsumerMetrics
from rlc.runtime.refit.protocol import Ack, Begin, Done, End, Error, decode, encode


class CountingSocket(zmq.Socket):
    """A real ZMQ socket that counts its polls."""

    polls = 0

    def poll(self, timeout=None, flags=zmq.POLLIN):
        type(self).polls += 1
        return super().poll(timeout, flags)


@pytest.fixture
def pair():
    ctx = zmq.Context()
    address = f"inproc://refit-channel-{uuid.uuid4().hex}"
    a = ctx.socket(zmq.PAIR, socket_class=CountingSocket)
    a.bind(address)
    b = ctx.socket(zmq.PAIR)
    b.connect(address)
    CountingSocket.polls = 0
    yield Channel(a, "this end", timeout_s=5.0), b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def _settled(sock: zmq.Socket) -> None:
    """Wait until the peer's message is in this socket's queue (inproc delivery is asynchronous)."""
    assert sock.poll(2000, zmq.POLLIN)


def test_a_queued_message_is_read_without_a_poll(pair):
    chan, peer = pair
    peer.send_multipart(encode(Ack(refit_id=1, index=0, loaded_bytes=8)))
    _settled(chan.sock)
    CountingSocket.polls = 0
    msg, payload = chan.recv("an ack")
    assert msg == Ack(refit_id=1, index=0, loaded_bytes=8) and payload is None
    assert CountingSocket.polls == 0


def test_nothing_queued_waits_and_times_out_with_what_it_waited_for(pair):
    chan, _peer = pair
    with pytest.raises(RefitTimeoutError, match="the consumer's manifest verdict"):
        chan.recv("the consumer's manifest verdict", timeout_s=0.3)
    assert CountingSocket.polls >= 1


def test_a_peer_error_already_queued_is_raised_by_the_next_receive(pair):
    chan, peer = pair
    peer.send_multipart(encode(Error(message="load_weights failed", where="vLLM worker")))
    _settled(chan.sock)
    with pytest.raises(RefitRemoteError, match="load_weights failed"):
        chan.recv("bucket 0")


def test_a_socket_with_room_is_written_without_a_poll(pair):
    chan, peer = pair
    chan.send(End(refit_id=2, num_buckets=1, num_tensors=3, total_bytes=96, kept_slots=[0]))
    assert CountingSocket.polls == 0
    assert decode(peer.recv_multipart())[0].kept_slots == [0]


def test_a_peer_that_stopped_reading_is_a_timeout_naming_the_message():
    ctx = zmq.Context()
    address = f"inproc://refit-channel-{uuid.uuid4().hex}"
    a = ctx.socket(zmq.PAIR)
    a.setsockopt(zmq.SNDHWM, 1)
    a.bind(address)
    b = ctx.socket(zmq.PAIR)
    b.setsockopt(zmq.RCVHWM, 1)
    b.connect(address)
    chan = Channel(a, "this end", timeout_s=5.0)
    try:
        with pytest.raises(RefitTimeoutError, match="'ack'"):
            for _ in range(100):  # the peer reads none: its queue and ours fill, then the send waits until its deadline
                chan.send(Ack(refit_id=1, index=0, loaded_bytes=0), timeout_s=0.3)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_the_messages_of_every_refit_round_trip_field_by_field():
    metrics = ConsumerMetrics(refit_id=4, producer_rank=1, device_key="GPU-x", num_buckets=3, seconds=0.25)
    assert metrics.to_dict() == dataclasses.asdict(metrics)
    for msg in (Begin(refit_id=4, plan={"half_bytes": 8, "buckets": [1, 2]}, device_ordered=True),
                Ack(refit_id=4, index=2, loaded_bytes=64),
                End(refit_id=4, num_buckets=3, num_tensors=5, total_bytes=640, kept_slots=[0, 1], kept_storages=[7]),
                Done(refit_id=4, consumer_metrics=metrics.to_dict())):
        assert decode(encode(msg))[0] == msg


def test_a_peer_error_already_queued_stops_the_next_send(pair):
    chan, peer = pair
    peer.send_multipart(encode(Error(message="manifest mismatch", where="vLLM worker")))
    _settled(chan.sock)
    with pytest.raises(RefitRemoteError, match="manifest mismatch"):
        chan.send(Ack(refit_id=1, index=0, loaded_bytes=0))
    assert not peer.poll(100, zmq.POLLIN)  # nothing was sent after the peer failed
