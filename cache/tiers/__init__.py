"""Tiers below the KV pool: host RAM, local disk and a shared remote store (Redis), keyed by
the pool's block hashes plus a fingerprint of the model and layout; a coordinator moves
pages between them and the pool (write-back on eviction, asynchronous promotion on a
prefix hit, swap on preemption)."""
from cache.tiers.base import EntryError, Tier, make_fingerprint, pack_entry, tier_key, unpack_entry
from cache.tiers.coordinator import TierCoordinator, needed_entries, prefix_coverage
from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier
from cache.tiers.remote import RedisTier
from cache.tiers.transfer import KVTransfers, run_transfers

__all__ = ["DiskTier", "EntryError", "HostTier", "KVTransfers", "RedisTier", "Tier", "TierCoordinator",
           "make_fingerprint", "needed_entries", "pack_entry", "prefix_coverage", "run_transfers", "tier_key",
           "unpack_entry"]
