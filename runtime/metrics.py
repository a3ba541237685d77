"""Prometheus metrics for the server (prometheus-client, own registry).

The engine thread updates them after each step; `/metrics` renders the registry. Names
follow the usual serving conventions (`*_total` counters, `*_seconds` histograms). Each
metric vLLM also has is rendered a second time under vLLM's name (`vllm:*`, with its label
spellings), so dashboards and `vllm bench` built for vLLM read this server unchanged.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


# Our metric name -> vLLM's (the same quantity): rendered under both.
VLLM_NAMES = {
    "zooinfer_num_requests_running": "vllm:num_requests_running",
    "zooinfer_num_requests_waiting": "vllm:num_requests_waiting",
    "zooinfer_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "zooinfer_num_preemptions": "vllm:num_preemptions",
    "zooinfer_prompt_tokens": "vllm:prompt_tokens",
    "zooinfer_generation_tokens": "vllm:generation_tokens",
    "zooinfer_request_success": "vllm:request_success",
    "zooinfer_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "zooinfer_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "zooinfer_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}
_VLLM_LABELS = {'finish_reason="': 'finished_reason="'}


def _vllm_aliases(text: str) -> str:
    """The lines of the metrics vLLM also has, renamed to vLLM's names and labels."""
    out = []
    for line in text.splitlines():
        body = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        for ours, theirs in VLLM_NAMES.items():
            if body.startswith(ours) and body[len(ours):len(ours) + 1] in ("", " ", "{", "_"):
                renamed = line.replace(ours, theirs, 1)
                for a, b in _VLLM_LABELS.items():
                    renamed = renamed.replace(a, b)
                out.append(renamed)
                break
    return "\n".join(out) + "\n"


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.running = Gauge("zooinfer_num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("zooinfer_num_requests_waiting", "Requests waiting for admission", labels, registry=r)
        self.kv_usage = Gauge("zooinfer_kv_cache_usage_perc", "Fraction of KV blocks in use", labels, registry=r)
        self.kv_group_blocks = Gauge("zooinfer_kv_cache_group_blocks_in_use",
                                     "KV blocks held per KV cache group", labels + ["group", "kind"], registry=r)
        self.kv_free = Gauge("zooinfer_kv_cache_free_blocks", "Free KV blocks", labels, registry=r)
        self.kv_total = Gauge("zooinfer_kv_cache_blocks", "Usable KV blocks", labels, registry=r)
        self.prefix_queries = Gauge("zooinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                    labels, registry=r)
        self.prefix_hits = Gauge("zooinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                 labels, registry=r)
        self.prefix_hit_rate = Gauge("zooinfer_prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries",
                                     labels, registry=r)
        self.preemptions = Counter("zooinfer_num_preemptions", "Requests preempted (recompute)", labels, registry=r)
        self.prompt_tokens = Counter("zooinfer_prompt_tokens", "Prompt tokens admitted", labels, registry=r)
        self.generation_tokens = Counter("zooinfer_generation_tokens", "Tokens generated", labels, registry=r)
        self.finished = Counter("zooinfer_request_success", "Finished requests by reason", labels + ["finish_reason"],
                                registry=r)
        self.ttft = Histogram("zooinfer_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("zooinfer_inter_token_latency_seconds", "Time between tokens of a request", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("zooinfer_e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.forks = Gauge("zooinfer_num_forks", "Requests forked from another's blocks (n > 1 samples, beams)",
                           labels, registry=r)
        # KV tiers (cache/tiers/): cumulative per-tier counters, set from the engine's stats.
        tier = labels + ["tier"]
        self.tier_hits = Gauge("zooinfer_kv_tier_hits", "KV tier entries loaded (hits)", tier, registry=r)
        self.tier_misses = Gauge("zooinfer_kv_tier_misses",
                                 "KV tier loads that found nothing valid (missing, corrupt or refused)", tier, registry=r)
        self.tier_bytes_loaded = Gauge("zooinfer_kv_tier_bytes_loaded", "Bytes loaded from a KV tier", tier, registry=r)
        self.tier_bytes_stored = Gauge("zooinfer_kv_tier_bytes_stored", "Bytes stored in a KV tier", tier, registry=r)
        self.tier_load_seconds = Gauge("zooinfer_kv_tier_load_seconds", "Seconds spent loading from a KV tier",
                                       tier, registry=r)
        self.tier_used = Gauge("zooinfer_kv_tier_used_bytes", "Bytes a KV tier holds", tier, registry=r)
        self.tier_hit_tokens = Gauge("zooinfer_kv_tier_hit_tokens", "Prompt tokens served from the KV tiers",
                                     labels, registry=r)
        self.swaps = Gauge("zooinfer_kv_swaps", "Preempted requests swapped out to / back in from host RAM",
                           labels + ["direction"], registry=r)
        self.model = model_name
        self._preemptions_seen = 0

    def update_engine_state(self, stats: dict) -> None:
        m = self.model
        self.running.labels(m).set(stats["num_running"])
        self.waiting.labels(m).set(stats["num_waiting"])
        self.kv_usage.labels(m).set(stats["usage"])
        self.kv_free.labels(m).set(stats["num_free_blocks"])
        self.kv_total.labels(m).set(stats["num_blocks"])
        for g in stats["groups"]:
            self.kv_group_blocks.labels(m, str(g["group"]), g["kind"]).set(g["blocks_in_use"])
        self.prefix_queries.labels(m).set(stats["prefix_cache_queries"])
        self.prefix_hits.labels(m).set(stats["prefix_cache_hits"])
        self.prefix_hit_rate.labels(m).set(stats["prefix_cache_hit_rate"])
        self.forks.labels(m).set(stats["forks"])
        tiers = stats.get("kv_tiers")
        if tiers is not None:
            for name, t in tiers["tiers"].items():
                self.tier_hits.labels(m, name).set(t["hits"])
                self.tier_misses.labels(m, name).set(t["misses"] + t["corrupt"] + t["refused"])
                self.tier_bytes_loaded.labels(m, name).set(t["bytes_loaded"])
                self.tier_bytes_stored.labels(m, name).set(t["bytes_stored"])
                self.tier_load_seconds.labels(m, name).set(t["load_seconds"])
                self.tier_used.labels(m, name).set(t["used_bytes"])
            self.tier_hit_tokens.labels(m).set(tiers["tier_hit_tokens"])
            self.swaps.labels(m, "out").set(tiers["swapped_out"])
            self.swaps.labels(m, "in").set(tiers["swapped_in"])
        new = stats["num_preemptions"] - self._preemptions_seen
        if new > 0:
            self.preemptions.labels(m).inc(new)
            self._preemptions_seen = stats["num_preemptions"]

    def render(self) -> bytes:
        text = generate_latest(self.registry).decode()
        return (text + _vllm_aliases(text)).encode()
