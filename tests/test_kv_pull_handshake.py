"""A pull's handshake (kv_transfer/p2p.py): the status word comes back through the producer's store,
and neither side touches the pair's process group before it. On GPUs an op posted early waits on
the device while the producer rank serves another pull, and the device's other NCCL kernels can
queue behind it (a deadlock seen on 4 x H200); here the order itself is checked, with a stand-in
store and pair groups."""
import pickle
import threading
import time
from collections import defaultdict

import pytest
import torch

from longserve.kv_transfer import p2p
from longserve.kv_transfer.topology import KVLayout
from longserve.kv_transfer.transfer import PieceRange


class Store:  # the TCPStore calls a pull makes
    def __init__(self, log):
        self.log, self.kv, self.queue, self.cv = log, {}, [], threading.Condition()

    def queue_push(self, key, value):
        with self.cv:
            self.queue.append(pickle.loads(value))
            self.cv.notify_all()

    def set(self, key, value):
        with self.cv:
            self.log.append(("producer", "reply"))
            self.kv[key] = value.encode()
            self.cv.notify_all()

    def get(self, key):
        with self.cv:
            assert self.cv.wait_for(lambda: key in self.kv, timeout=5), "no reply"
            return self.kv[key]

    def delete_key(self, key):
        with self.cv:
            return self.kv.pop(key, None) is not None


class Groups:  # records when a side first touches the pair's group
    def __init__(self, log, side):
        self.log, self.side = log, side

    def get(self, store, pair, rank):
        self.log.append((self.side, "group"))
        return object()

    def send_all(self, group, payloads, deadline):
        self.log.append((self.side, "send"))


def producer(log, held: bool):
    w = object.__new__(p2p.P2pConnectorWorker)
    w.groups, w.caches, w.lock, w.progress = Groups(log, "producer"), [torch.zeros(1)] * 4, \
        threading.Lock(), threading.Event()
    w._same_scales = lambda msg: True
    w._take_reader = lambda req_id: p2p.Held([0, 1], time.time() + 60) if held else None
    w._payloads = lambda *a: iter(())
    return w


def consumer(log):
    w = object.__new__(p2p.P2pConnectorWorker)
    w.groups, w.caches = Groups(log, "consumer"), [torch.zeros(1)] * 4
    w.layout = KVLayout(2, 16, 1, 1, 1, 1, "NHD", "float32")
    w._recv_pieces = lambda *a: log.append(("consumer", "recv"))
    return w


@pytest.mark.timeout(30)
@pytest.mark.parametrize("held", [True, False])
def test_no_pair_op_before_the_producer_answers(held):
    log, times, result = [], defaultdict(float), []
    store, cons = Store(log), consumer(log)
    pull = threading.Thread(target=lambda: result.append(cons._pull(
        store, {"remote_engine_id": "p", "remote_request_id": "7"}, 0, "p/0/c/0/0", [],
        cons.layout, PieceRange(0, 32, (0, 1), (3, 4)), times)))
    pull.start()
    with store.cv:
        assert store.cv.wait_for(lambda: store.queue, timeout=5)
    time.sleep(0.2)  # the producer rank is busy elsewhere: the consumer must not have started
    assert log == []
    producer(log, held)._serve(store.queue[0], store)
    pull.join(10)
    assert result == [held]
    if held:
        assert log[:2] == [("producer", "reply"), ("producer", "group")]
        assert log.index(("consumer", "group")) > 0 and log[-1] == ("consumer", "recv")
    else:  # a request no longer held: no group on either side
        assert log == [("producer", "reply")]
    assert store.kv == {}  # the reply was taken
    assert times.keys() >= {"post_s", "status_s", "setup_s", "pull_s"}
