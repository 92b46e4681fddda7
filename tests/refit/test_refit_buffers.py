"""Buffer backends and the ZMQ channel in one process: views, leaks, deadlines, socket names."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import zmq

from rlc.runtime.refit.buffers import ShmBackend, make_backend
from rlc.runtime.refit.channel import Channel, bind, bound_path, endpoint, new_socket, pid_alive
from rlc.runtime.refit.errors import RefitLeakError, RefitProtocolError, RefitTimeoutError
from rlc.runtime.refit.protocol import Ack, BufferRef


def _pair(nbytes: int = 4096):
    backend = ShmBackend("shm-test")
    owned, payload = backend.allocate(nbytes, "half0")
    opened = backend.open(BufferRef(0, nbytes, "shm", "shm-test"), payload, "half0")
    return backend, owned, opened


def test_shm_segments_are_unlinked_on_close():
    _, owned, opened = _pair()
    name = owned.unlink_name
    assert os.path.exists(f"/dev/shm/{name}")
    opened.close()
    owned.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_shm_views_alias_the_same_bytes_across_mappings():
    _, owned, opened = _pair()
    src = torch.arange(16, dtype=torch.float32) * 1.5
    w = owned.view(256, 64, (4, 4), torch.float32, "w")
    w.copy_(src.view(4, 4))
    r = opened.view(256, 64, (4, 4), torch.float32, "w")
    assert torch.equal(r.flatten(), src)
    bias = owned.view(512, 4, (2,), torch.bfloat16, "b")
    bias.copy_(torch.tensor([30.0, -2.0]))
    assert opened.view(512, 4, (2,), torch.bfloat16, "b").tolist() == [30.0, -2.0]
    del w, r, bias
    opened.close()
    owned.close()


def test_a_kept_view_is_a_leak_and_blocks_close():
    _, owned, opened = _pair()
    kept = opened.view(0, 64, (16,), torch.float32, "model.layers.0.w")
    with pytest.raises(RefitLeakError, match="'model.layers.0.w'.*must"):
        opened.check_no_live_views("consumer")
    with pytest.raises(RefitLeakError, match="closed while views are still referenced"):
        opened.close()
    owned.close()
    kept.fill_(1.0)  # the leaked view still points at valid (still mapped) memory, no crash
    assert kept.sum().item() == 16.0


def test_views_outside_the_buffer_are_refused():
    _, owned, opened = _pair(1024)
    with pytest.raises(RefitProtocolError, match="outside buffer"):
        opened.view(1000, 64, (16,), torch.float32, "w")
    opened.close()
    owned.close()


def test_a_consumer_cannot_open_another_devices_buffer():
    backend = ShmBackend("gpu-A")
    owned, payload = backend.allocate(256, "half0")
    with pytest.raises(RefitProtocolError, match="belongs to device 'gpu-A'"):
        ShmBackend("gpu-B").open(BufferRef(0, 256, "shm", "gpu-A"), payload, "half0")
    owned.close()
    with pytest.raises(ValueError, match="explicit device_key"):
        make_backend("shm")


def test_channel_send_without_a_peer_times_out_with_a_clear_error():
    sock = new_socket(zmq.PAIR)
    bind(sock, endpoint("t" + str(time.time_ns()), "lonely"))
    chan = Channel(sock, "refit producer rank 3 (GPU x)", timeout_s=0.5)
    t0 = time.monotonic()
    expected = r"refit producer rank 3 \(GPU x\): no progress on sending 'ack' within 0.5 s"
    with pytest.raises(RefitTimeoutError, match=expected):
        chan.send(Ack(refit_id=1, index=0, loaded_bytes=0))
    assert time.monotonic() - t0 < 3
    with pytest.raises(RefitTimeoutError, match="no progress on the ack of bucket 0"):
        chan.recv("the ack of bucket 0")
    path = bound_path(sock)
    assert os.path.exists(path)
    chan.close()
    assert not os.path.exists(path)  # the socket file is removed with the socket


def test_channel_notices_a_dead_peer_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    sock = new_socket(zmq.PAIR)
    bind(sock, endpoint("t" + str(time.time_ns()), "dead"))
    chan = Channel(sock, "refit consumer", timeout_s=30, peer_pid=proc.pid)
    chan.peer_name = "its producer"
    t0 = time.monotonic()
    with pytest.raises(RefitTimeoutError, match=rf"its producer \(pid {proc.pid}\) died"):
        chan.recv("bucket 0")
    assert time.monotonic() - t0 < 2
    chan.close()


def test_socket_names_are_keyed_and_short_enough():
    a = endpoint("job42", "GPU-3b8f0c2e-1111-2222-3333-444455556666")
    assert a == "ipc:///tmp/rlc-refit-job42-GPU-3b8f0c2e-1111-2222-3333-444455556666.sock"
    long = endpoint("x" * 200, "GPU-3b8f0c2e-1111-2222-3333-444455556666")
    assert len(long) - len("ipc://") <= 100 and long == endpoint("x" * 200, "GPU-3b8f0c2e-1111-2222-3333-444455556666")
    assert endpoint("x" * 200, "a") != endpoint("x" * 200, "b")


def test_specs_from_an_exporter_pass_keep_order_and_dtypes():
    from rlc.runtime.refit.specs import specs_from_named_tensors

    def exporter():
        yield "b.weight", torch.zeros(3, 4, dtype=torch.bfloat16)
        yield "a.e_score_correction_bias", torch.zeros(4, dtype=torch.float32)
        yield "a.counts", torch.zeros(2, dtype=torch.int64)

    specs = specs_from_named_tensors(exporter())
    assert [(s.name, s.shape, s.dtype, s.nbytes) for s in specs] == [
        ("b.weight", (3, 4), "bfloat16", 24),
        ("a.e_score_correction_bias", (4,), "float32", 16),
        ("a.counts", (2,), "int64", 16),
    ]


def test_typed_views_alias_the_right_bytes_for_every_dtype_and_offset():
    backend = ShmBackend("shm-views")
    owned, payload = backend.allocate(4096, "half0")
    opened = backend.open(BufferRef(0, 4096, "shm", "shm-views"), payload, "half0")
    src = {
        (0, torch.float32, (4, 8)): torch.arange(32, dtype=torch.float32),
        (256, torch.bfloat16, (3, 5)): torch.arange(15, dtype=torch.float32).to(torch.bfloat16),
        (512, torch.int64, (2,)): torch.tensor([7, -9], dtype=torch.int64),
        (1024, torch.bfloat16, ()): torch.tensor(3.5, dtype=torch.bfloat16),
        (1030, torch.uint8, (3,)): torch.tensor([1, 2, 3], dtype=torch.uint8),  # unaligned to 8: still right
    }
    for (offset, dtype, shape), values in src.items():
        nbytes = values.numel() * values.element_size()
        w = owned.view(offset, nbytes, shape, dtype, "w", track=False)
        w.copy_(values.view(shape))
        del w
    raw = opened.tensor
    for (offset, dtype, shape), values in src.items():
        nbytes = values.numel() * values.element_size()
        got = opened.view(offset, nbytes, shape, dtype, "r")
        assert got.shape == torch.Size(shape) and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, values.view(shape))
        assert torch.equal(raw[offset:offset + nbytes], values.reshape(-1).view(torch.uint8))
        del got
    assert owned.live_views() == []  # untracked producer views
    opened.close()
    owned.close()
