"""The side-by-side bench's pure helpers and its peer protocol (no peer engine needed).

FLOP counts are checked against a token-by-token count written out the slow way, the protocol
against a stand-in runner started through the real `PeerProcess` (stop/continue included).
"""
from __future__ import annotations

import shutil
import sys
import textwrap

import pytest

from bench.peers import HERE
from bench.peers.client import PeerError, PeerProcess
from bench.peers.compare import (_attended_keys, agreement, gemm_shapes, measure_gemm_rate, paired_speedup, summarize,
                                 workload_flops)

LLAMA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)


def slow_flops(cfg: dict, prompt_lens: list[int], new_tokens: int) -> int:
    """Every matmul of every fed token, one token at a time."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    total = 0
    for p in prompt_lens:
        fed = p + new_tokens - 1
        for t in range(fed):
            for lt in types:
                total += 2 * h * nh * hd + 2 * 2 * h * nkv * hd + 2 * nh * hd * h + 3 * 2 * h * inter
                keys = t + 1
                if lt == "sliding_attention":
                    keys = min(keys, cfg["sliding_window"])
                total += 2 * 2 * nh * hd * keys
        total += new_tokens * 2 * h * vocab
    return total


@pytest.mark.parametrize("n,window", [(1, None), (7, None), (7, 3), (3, 7), (16, 16), (17, 16)])
def test_attended_keys_matches_sum(n, window):
    want = sum(min(t + 1, window) if window else t + 1 for t in range(n))
    assert _attended_keys(n, window) == want


def test_workload_flops_llama_exact():
    f = workload_flops(LLAMA, [5, 9, 1], 4)
    assert f["total"] == slow_flops(LLAMA, [5, 9, 1], 4)
    assert f["body_tokens"] == (5 + 3) + (9 + 3) + (1 + 3)
    assert f["sampled_tokens"] == 12
    assert f["lm_head"] == 12 * 2 * 64 * 1000
    assert f["linear"] + f["lm_head"] + f["attention"] == f["total"]


def test_workload_flops_sliding_layers_and_head_dim():
    cfg = dict(LLAMA, head_dim=32, sliding_window=4,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    f = workload_flops(cfg, [10, 3], 6)
    assert f["total"] == slow_flops(cfg, [10, 3], 6)
    full = workload_flops(dict(cfg, layer_types=None), [10, 3], 6)
    assert full["attention"] > f["attention"] and full["linear"] == f["linear"]


def test_gemm_shapes_follow_config():
    assert gemm_shapes(LLAMA, 2048, 64) == [(2048, 64, 160), (2048, 160, 64), (2048, 64, 64),
                                           (64, 64, 160), (64, 64, 1000)]


def test_gemm_peak_is_the_best_of_torch_mm_and_our_kernels():
    """The peak behind "% of peak" counts our own panel kernels (MKL runs AVX2 code on AMD, so
    torch.mm alone put engines above 100%), and the kernels it times compute that very product."""
    import torch
    from zooinfer_kernels import cpu_build, gemm
    shapes = [(48, 64, 96), (8, 64, 96)]
    rate = measure_gemm_rate(shapes, seconds_per_shape=0.01)
    assert set(rate["per_shape_gflops"]) == {"48x64x96", "8x64x96"}
    if not cpu_build.available():
        assert rate["ours_per_shape_gflops"] == {} and rate["peak_kernel"] == "torch.mm"
        pytest.skip("the C++ CPU kernels are unavailable: torch.mm alone")
    assert set(rate["ours_per_shape_gflops"]) == set(rate["per_shape_gflops"])
    everything = [*rate["per_shape_gflops"].values(), *rate["ours_per_shape_gflops"].values()]
    assert rate["peak_gflops"] == max(everything) > 0
    best_mm, best_ours = max(rate["per_shape_gflops"].values()), max(rate["ours_per_shape_gflops"].values())
    assert rate["peak_kernel"] == ("ours" if best_ours > best_mm else "torch.mm")
    a, b = torch.randn(48, 64), torch.randn(64, 96)
    panels = gemm.pack_panels(b.t().contiguous())
    with torch.no_grad():
        for kernel, rows in ((gemm.panel_linear_blocked, a), (gemm.panel_linear, a[:8])):
            torch.testing.assert_close(kernel(rows, panels, 96, None), rows @ b, rtol=1e-4, atol=1e-4)


def test_agreement_counts_and_prefixes():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    got = [[1, 2, 3], [4, 0, 6], [0, 8, 9]]
    a = agreement(got, ref)
    assert (a["equal"], a["total"], a["min_common_prefix"], a["distinct_tokens"]) == (1, 3, 0, 8)
    assert a["mean_common_prefix"] == pytest.approx((3 + 1 + 0) / 3)
    with pytest.raises(ValueError, match="2 outputs vs 3"):
        agreement(got[:2], ref)


def test_paired_speedup_is_per_round():
    p = paired_speedup([1.0, 2.0, 1.5], [1.5, 2.0, 3.0])    # the other engine's seconds / ours, round by round
    assert p["per_round"] == [1.5, 1.0, 2.0] and p["median"] == 1.5 and (p["min"], p["max"]) == (1.0, 2.0)
    with pytest.raises(ValueError, match="rounds"):
        paired_speedup([1.0], [1.0, 2.0])


def test_summarize_median_and_spread():
    s = summarize([2.0, 4.0, 1.0], 100)
    assert s["out_tok_s"] == [50.0, 25.0, 100.0]
    assert (s["median_out_tok_s"], s["min_out_tok_s"], s["max_out_tok_s"]) == (50.0, 25.0, 100.0)


FAKE_RUNNER = """
import os, sys
sys.path.insert(0, {peers_dir!r})
from protocol import serve

def load(wl):
    print("noise on stdout must not reach the protocol stream")
    return {{"offset": wl["options"]["offset"], "calls": 0}}

def generate(engine, prompts, n):
    engine["calls"] += 1
    if engine["calls"] > 3:
        raise RuntimeError("third round exploded")
    return [[(t + engine["offset"]) for t in p[:n]] for p in prompts]

sys.exit(serve(load, generate, "fake 1.0"))
"""


def test_peer_process_round_trip(tmp_path):
    script = tmp_path / "run_fake.py"
    script.write_text(textwrap.dedent(FAKE_RUNNER.format(peers_dir=str(HERE))))
    wl = {"prompts": [[1, 2, 3], [4, 5]], "new_tokens": 2, "warmup_prompts": [[9]], "warmup_new_tokens": 1,
          "options": {"offset": 10}}
    proc = PeerProcess("fake", wl, {}, python=sys.executable, script=script, timeout_s=60)
    try:
        assert proc.ready["version"] == "fake 1.0" and proc.ready["load_s"] >= 0
        for _ in range(2):   # warm-up was call 1; rounds are calls 2 and 3
            res = proc.run()
            assert res["outputs"] == [[11, 12], [14, 15]] and res["seconds"] >= 0
        with pytest.raises(PeerError, match="fake: RuntimeError: third round exploded"):
            proc.run()
    finally:
        proc.close()
    assert proc.proc.returncode == 1 and proc.log_path.exists()   # a failed runner keeps its log
    assert "third round exploded" in proc.log_path.read_text()
    shutil.rmtree(proc.dir)


def test_peer_process_missing_venv_is_one_line(tmp_path):
    with pytest.raises(PeerError, match=r"nope: no python at .*python_missing; run `python -m bench.peers.setup nope`"):
        PeerProcess("nope", {}, {}, python=str(tmp_path / "python_missing"))


def test_choose_engines():
    from bench.throughput import choose_engines
    assert choose_engines("hf,ours", None) == ["hf", "ours"]
    assert choose_engines(None, "hf-cb,vllm,ours") == ["ours", "hf-cb", "vllm"]
    assert choose_engines(None, None)[:2] == ["ours", "hf"]
    with pytest.raises(SystemExit, match="unknown engine.*sglang"):
        choose_engines(None, "sglang")


def test_ours_loads_the_zoo_spec_for_gguf_on_embedded_models(tmp_path):
    """`--quantization gguf` on smollm2 / gemma3 gives our engine the zoo spec (which names the
    embedded GGUF); every other method, and any other model, keeps the path it was given."""
    from bench.throughput import ours_path
    hf = tmp_path / "gemma3-270m"
    assert ours_path("gemma3-270m", hf, "gguf").name == "gemma3-270m.yaml"
    assert ours_path("gemma3-270m", hf, "gguf").is_file()
    assert ours_path("smollm2-135m", hf, "gguf").name == "smollm2-135m.yaml"
    assert ours_path("gemma3-270m", hf, "int4_asym") == hf
    assert ours_path("gemma3-270m", hf, None) == hf
    assert ours_path("tiny-llama", hf, "gguf") == hf


def test_llamacpp_rope_permutation_maps_hf_rope_to_interleaved_rope():
    """The GGUF writer permutes Q/K rows so llama.cpp's interleaved rope on the permuted weights
    gives the same vector as HF's rotate-half rope, up to that same row order (so q.k is equal)."""
    import numpy as np
    from bench.peers.run_llamacpp import _permute_rope
    rng = np.random.default_rng(0)
    n_head, hd, hidden, pos = 3, 8, 12, 5
    w = rng.standard_normal((n_head * hd, hidden))
    x = rng.standard_normal(hidden)
    ang = pos * 10000.0 ** (-np.arange(hd // 2) * 2 / hd)
    cos, sin = np.cos(ang), np.sin(ang)

    def hf_rope(q):                     # per head: halves [a | b] -> [a cos - b sin | b cos + a sin]
        q = q.reshape(n_head, hd)
        a, b = q[:, :hd // 2], q[:, hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)

    def interleaved_rope(q):            # per head: pairs (2i, 2i+1) rotated by angle i
        q = q.reshape(n_head, hd // 2, 2)
        a, b = q[..., 0], q[..., 1]
        return np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(n_head, hd)

    got = interleaved_rope(_permute_rope(w, n_head) @ x)
    want = _permute_rope(hf_rope(w @ x).reshape(n_head * hd, 1), n_head).reshape(n_head, hd)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(interleaved_rope(w @ x), hf_rope(w @ x))   # the permutation matters
