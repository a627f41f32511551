"""The KV connector API in vLLM v1's shape, implemented by `offload` and `p2p` (the engine holds at
most one of each side; what each call does: docs/architecture.md, 'KV transfer'). Scheduler side
(engine process, owns every block's lifetime): get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, request_finished, has_pending. Worker side (every rank): register_kv_caches,
start_load_kv before the forward (and the zeroing), wait_for_save after it, get_finished,
get_block_ids_with_load_errors."""
from __future__ import annotations

from longserve.kv_transfer.utils import KVConnectorOutput


def connector_output(worker_connector, finished_req_ids) -> KVConnectorOutput:
    sending, recving = worker_connector.get_finished(set(finished_req_ids))
    return KVConnectorOutput(set(sending), set(recving),
                             set(worker_connector.get_block_ids_with_load_errors()))


def build_worker_connector(config, ps, device):
    """The worker side for this engine's KV transfer config (None: no connector)."""
    kvt = config.kv_transfer
    if kvt.kv_offload_bytes:
        from longserve.kv_transfer.offload import OffloadConnectorWorker
        return OffloadConnectorWorker(config, device)
    if kvt.kv_role is not None:
        from longserve.kv_transfer.p2p import P2pConnectorWorker
        return P2pConnectorWorker(config, ps, device)
    return None


def build_scheduler_connector(config, kv_manager, bytes_per_block: int, store=None):
    """The scheduler side for this engine's KV transfer config (None: none); `store`: p2p.host_store's."""
    kvt = config.kv_transfer
    if kvt.kv_offload_bytes:
        from longserve.kv_transfer.offload import OffloadConnectorScheduler
        conn = OffloadConnectorScheduler(kvt.kv_offload_bytes // bytes_per_block, kv_manager.tokens_per_block)
        kv_manager.on_evict = conn.on_evict
        return conn
    if kvt.kv_role is not None:
        from longserve.kv_transfer.p2p import P2pConnectorScheduler
        return P2pConnectorScheduler(config, kv_manager, store)
    return None
