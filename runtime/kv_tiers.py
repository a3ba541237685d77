"""Engine set-up of the KV tiers (cache/tiers/): which tiers, their fingerprint, the hooks.

The fingerprint covers what makes a page's bytes mean something: the model (its spec name
and a sample of every weight: name, shape, dtype and up to 1024 evenly spaced values, so two
checkpoints of one architecture differ), the KV layout (block size, page bytes, buffers, every
group's spec with its dtype and layers) and the user's `kv_tier_salt`. Engines that agree on
all of it share entries through a disk folder or a Redis server; others never see them.
A draft model's weights (speculative decoding) join the sample: its KV lives in the same
pages, so engines whose drafts differ must not share entries.
"""
from __future__ import annotations

import os

import torch

from cache.kv_cache_spec import KVCacheConfig
from cache.tiers import DiskTier, HostTier, RedisTier, TierCoordinator, make_fingerprint
from cache.tiers.swap import MODES
from cache.tiers.transfer import payload_bytes, run_transfers


def model_fingerprint(model: torch.nn.Module, spec_name: str, kv_config: KVCacheConfig, salt: str,
                      draft: torch.nn.Module | None = None) -> bytes:
    parts: list[bytes | str] = [spec_name, salt, f"bs={kv_config.block_size} page={kv_config.page_size_bytes} "
                                               f"buffers={kv_config.num_buffers}"]
    parts += [f"{type(g.spec).__name__}{g.spec!r}{g.layer_ids}" for g in kv_config.groups]
    state = dict(model.state_dict())
    if draft is not None:
        state.update({f"<draft>.{k}": v for k, v in draft.state_dict().items()})
    with torch.no_grad():
        for name, t in sorted(state.items()):
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 1024)][:1024].to("cpu").contiguous()
            parts += [f"{name}{tuple(t.shape)}{t.dtype}", sample.view(torch.uint8).numpy().tobytes()]
    return make_fingerprint(parts)


def _check_bytes(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")


def attach_tiers(engine, config, kv_config: KVCacheConfig) -> TierCoordinator | None:
    """Build the configured tiers (host RAM, disk, remote, top to bottom) and hook their
    coordinator into the engine's scheduler; None when no tier is configured."""
    if config.preemption_mode not in MODES:
        raise ValueError(f"preemption_mode must be one of {', '.join(MODES)}, got {config.preemption_mode!r}")
    if not isinstance(config.swap_min_tokens, int) or isinstance(config.swap_min_tokens, bool) \
            or config.swap_min_tokens < 1:
        raise ValueError(f"swap_min_tokens must be a positive integer, got {config.swap_min_tokens!r}")
    _check_bytes("kv_host_tier_bytes", config.kv_host_tier_bytes)
    _check_bytes("kv_disk_tier_bytes", config.kv_disk_tier_bytes)
    if not isinstance(config.kv_tier_write_through, bool):
        raise ValueError(f"kv_tier_write_through must be True or False, got {config.kv_tier_write_through!r}")
    if not isinstance(config.kv_tier_salt, str):
        raise ValueError(f"kv_tier_salt must be a string, got {config.kv_tier_salt!r}")
    if config.kv_disk_tier_dir is not None and not isinstance(config.kv_disk_tier_dir, (str, os.PathLike)):
        raise ValueError(f"kv_disk_tier_dir must be a path, got {config.kv_disk_tier_dir!r}")
    if config.kv_remote_tier_url is not None:
        RedisTier.check_url(config.kv_remote_tier_url)
    if config.preemption_mode == "swap" and not config.kv_host_tier_bytes:
        raise ValueError("preemption_mode='swap' needs a host tier: set kv_host_tier_bytes")
    if not (config.kv_host_tier_bytes or config.kv_disk_tier_dir or config.kv_remote_tier_url):
        return None
    if not config.enable_prefix_caching:
        raise ValueError("KV tiers are keyed by prefix-cache block hashes: they need enable_prefix_caching=True")
    if config.kv_disk_tier_dir is not None and not config.kv_disk_tier_bytes:
        raise ValueError("kv_disk_tier_bytes must be > 0 with kv_disk_tier_dir")
    remote = None
    if config.kv_remote_tier_url is not None:      # first: an unreachable server fails before any work
        try:
            remote = RedisTier(config.kv_remote_tier_url)
        except ValueError:
            raise
        except ImportError:
            raise ValueError("kv_remote_tier_url needs the redis client: pip install redis") from None
        except Exception as e:  # noqa: BLE001 - one line naming the setting
            raise ValueError(f"kv_remote_tier_url {config.kv_remote_tier_url!r}: cannot reach it "
                             f"({type(e).__name__}: {e})") from None
    draft = getattr(getattr(engine.spec_decoder, "proposer", None), "model", None)
    fp = model_fingerprint(engine.model, engine.spec.name, kv_config, config.kv_tier_salt, draft)
    tiers = [HostTier(config.kv_host_tier_bytes)] if config.kv_host_tier_bytes else []
    if config.kv_disk_tier_dir is not None:
        tiers.append(DiskTier(config.kv_disk_tier_dir, config.kv_disk_tier_bytes, fp))
    if remote is not None:
        tiers.append(remote)
    sizes = [payload_bytes(spans) for spans in engine.runner._copy_spans]
    coordinator = TierCoordinator(engine.kv_manager, tiers, fp, sizes, preemption_mode=config.preemption_mode,
                                  swap_min_tokens=config.swap_min_tokens,
                                  write_through=config.kv_tier_write_through)
    engine.scheduler.tiers = coordinator
    return coordinator


def close_tiers(engine) -> None:
    """Persist the pool's cached blocks and the host tier to the disk / remote tiers, then
    stop the tiers' I/O threads (engine shutdown; between steps)."""
    tiers = engine.tiers
    if tiers is None:
        return
    if len(tiers.tiers) > (tiers.host is not None):
        runner = engine.runner
        tiers.persist(lambda t: run_transfers(t, runner._copy_spans, runner.device))
    tiers.close()
    engine.tiers = engine.scheduler.tiers = None
