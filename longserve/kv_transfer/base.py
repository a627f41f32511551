"""The KV connector API, in vLLM v1's shape (flow: docs/architecture.md, 'KV transfer').
Implemented by `offload` and `p2p`; the engine holds at most one of each side.

Scheduler side (engine process, owns every block's lifetime):
  get_num_new_matched_tokens(request, num_computed_tokens) -> (num_external_tokens, load_async)
  update_state_after_alloc(request, block_ids, num_external_tokens)
  build_connector_meta(scheduler_output) -> step-plan metadata (`filled_block_ids`: not zeroed)
  request_finished(request, block_ids) -> (delay_free, kv_transfer_params)
  has_pending() -> whether workers must keep stepping (held blocks, loads in flight)
Worker side (every rank):
  register_kv_caches(kv_caches, kv_scales or None)   {layer name: tensor}
  start_load_kv(metadata) before the forward (and the zeroing); wait_for_save() after it
  get_finished(finished_req_ids) -> (finished_sending, finished_recving)
  get_block_ids_with_load_errors() -> set of block ids"""
from __future__ import annotations

from longserve.kv_transfer.utils import KVConnectorOutput


def connector_output(worker_connector, finished_req_ids) -> KVConnectorOutput:
    """One worker's report after a step."""
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
        from longserve.kv_transfer.offload import OffloadConnectorScheduler, num_host_blocks
        conn = OffloadConnectorScheduler(num_host_blocks(kvt.kv_offload_bytes, bytes_per_block),
                                         kv_manager.tokens_per_block)
        kv_manager.on_evict = conn.on_evict
        return conn
    if kvt.kv_role is not None:
        from longserve.kv_transfer.p2p import P2pConnectorScheduler
        return P2pConnectorScheduler(config, kv_manager, store)
    return None
