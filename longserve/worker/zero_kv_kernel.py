"""KVBlockZeroer's kernel (worker/utils.py): newly allocated KV blocks of every layer zeroed in one
launch, on CUDA (or on CPU under TRITON_INTERPRET=1)."""
import triton
import triton.language as tl

# Bytes zeroed by one program: 16 KiB = 128 threads x 8 stores of 16 bytes.
MAX_CHUNK_BYTES = 16384


@triton.jit
def zero_kv_blocks_kernel(seg_table_ptr, block_ids_ptr, CHUNK_BYTES: tl.constexpr):
    """Zero chunk pid(2) of segment pid(1) of block block_ids[pid(0)]. seg_table: int64
    [num_segments, 2] = (absolute address of the segment's block 0, bytes per block)."""
    block_id = tl.load(block_ids_ptr + tl.program_id(0)).to(tl.int64)
    seg = tl.program_id(1)
    chunk_start = tl.program_id(2).to(tl.int64) * CHUNK_BYTES
    seg_base = tl.load(seg_table_ptr + 2 * seg)
    page_bytes = tl.load(seg_table_ptr + 2 * seg + 1)
    if chunk_start < page_bytes:  # segments with smaller pages need fewer chunks
        start = (seg_base + block_id * page_bytes + chunk_start).to(tl.pointer_type(tl.int32))
        start = tl.multiple_of(start, 16)  # host checked 16-byte alignment: 128-bit stores
        words = start + tl.arange(0, CHUNK_BYTES // 4)
        tl.store(words, tl.zeros([CHUNK_BYTES // 4], dtype=tl.int32))
