"""KV cache pools: contiguous slots or paged blocks behind one protocol."""

from infer.cache.paged import PagedKVCachePool
from infer.cache.protocol import CacheFullError, CachePoolProtocol, KVBatch, build_kv_batch
from infer.cache.slotted import SlottedKVCache

__all__ = ["CacheFullError", "CachePoolProtocol", "KVBatch", "PagedKVCachePool", "SlottedKVCache", "build_kv_batch"]
