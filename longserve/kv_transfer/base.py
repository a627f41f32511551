"""The KV connector API, in vLLM v1's shape: a scheduler side and a worker side.

Two connectors implement it: `offload` (device blocks <-> a host pool) and `p2p` (prefill/
decode disaggregation between instances). The engine holds at most one of each side.

Scheduler side (engine process, owns every block's lifetime):
  get_num_new_matched_tokens(request, num_computed_tokens) -> (num_external_tokens, load_async)
      how many prompt tokens after the local prefix-cache hit can be loaded from outside;
      load_async: the request waits (blocks allocated) until the workers report the load done.
  update_state_after_alloc(request, block_ids, num_external_tokens)
      the request's blocks are allocated: remember which of them the load fills.
  build_connector_meta(scheduler_output) -> metadata carried in the step plan
      (a `filled_block_ids` attribute: blocks the workers' connector initialises itself).
  request_finished(request, block_ids) -> (delay_free, kv_transfer_params)
      delay_free: keep the blocks until the workers report the request finished sending
      (a producer's lease); kv_transfer_params go back to the client.
  has_pending() -> whether workers must keep stepping (held blocks, loads in flight).

Worker side (every rank):
  register_kv_caches(kv_caches: dict[layer name, tensor], kv_scales: dict[layer name, tensor]
                     or None)  the FP8 cache's per-head scales (None: the model's dtype)
  start_load_kv(metadata)     before the forward pass (and before new blocks are zeroed)
  wait_for_save()             after the forward pass
  get_finished(finished_req_ids) -> (finished_sending, finished_recving)
  get_block_ids_with_load_errors() -> set of block ids whose load failed"""
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
    """The scheduler side for this engine's KV transfer config (None: no connector).
    `store`: the producer's TCP store (hosted by the engine, see p2p.host_store)."""
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
