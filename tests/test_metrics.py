"""/metrics renders vLLM's names beside ours, with the same values."""
from __future__ import annotations

from runtime.metrics import VLLM_NAMES, ServerMetrics
from tests.serving import metric


def test_vllm_aliases_carry_the_same_values():
    m = ServerMetrics("x")
    m.finished.labels("x", "length").inc(3)
    m.ttft.labels("x").observe(0.2)
    m.generation_tokens.labels("x").inc(17)
    m.update_engine_state({"num_running": 4, "num_waiting": 2, "usage": 0.25, "num_free_blocks": 3, "num_blocks": 4,
                           "groups": [], "prefix_cache_queries": 9, "prefix_cache_hits": 5,
                           "prefix_cache_hit_rate": 5 / 9, "forks": 0, "num_preemptions": 2})
    text = m.render().decode()
    for ours, theirs in [("zooinfer_num_requests_running", "vllm:num_requests_running"),
                         ("zooinfer_kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
                         ("zooinfer_num_preemptions_total", "vllm:num_preemptions_total"),
                         ("zooinfer_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("zooinfer_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count")]:
        assert metric(text, theirs) == metric(text, ours)
    assert 'vllm:request_success_total{finished_reason="length",model_name="x"} 3.0' in text
    assert "vllm:num_forks" not in text and len(VLLM_NAMES) == 10
