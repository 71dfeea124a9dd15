"""Convert a legacy llama2.c checkpoint and tokenizer into a Hugging Face Llama directory.

Usage: python scripts/convert_llama2c.py [--checkpoint PATH] [--tokenizer PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_MODEL_DIR = Path("/work/shared/data/models/stories260K")
DEFAULT_CHECKPOINT = SHARED_MODEL_DIR / "stories260K.bin"
DEFAULT_TOKENIZER = SHARED_MODEL_DIR / "tok512.bin"
DEFAULT_OUT = REPO_ROOT / "nvllm" / "assets" / "stories260K"

HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
SPACE = "\u2581"  # the sentencepiece word-boundary marker, stored as ' ' in llama2.c tokenizers
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
N_BYTES = 256  # byte-fallback pieces <0x00>..<0xFF> at ids 3..258

# Provenance of the shared copies, as /work/shared/data/README.md states it (matched by sha256).
KNOWN_SOURCES = {
    "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696": (
        "DaveBben/esp32-llm @ 934dab4d242d259abd88678488ea3b62d4fca601, path `data/stories260K.bin`. "
        "License: no license file in the origin repo; its README says this is the karpathy/tinyllamas "
        "stories260K checkpoint (that HF model card says license: mit - not checkable from here)."
    ),
    "037cb335abb25d1fa9e8ecae30ed2a3a8ace9302862ebcdc05d51a6bbb10c312": (
        "DaveBben/esp32-llm @ 934dab4d242d259abd88678488ea3b62d4fca601, path `data/tok512.bin` "
        "(byte-identical to tairov/llama2.mojo @ 3c556c31b0aafb6bde26f3f6d716ca10707ccf23 `t260.bin`, MIT). "
        "License: no license file in the origin repo; the identical copy in tairov/llama2.mojo is under MIT."
    ),
}


def read_checkpoint(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a legacy (version 0) llama2.c checkpoint into a header dict and HF-named fp32 tensors."""
    data = path.read_bytes()
    cfg = dict(zip(HEADER_FIELDS, struct.unpack_from("<7i", data, 0)))
    cfg["shared_classifier"] = cfg["vocab_size"] > 0  # a negative vocab size flags a separate wcls
    cfg["vocab_size"] = abs(cfg["vocab_size"])
    dim, hidden, n_layers = cfg["dim"], cfg["hidden_dim"], cfg["n_layers"]
    vocab, seq_len, n_heads, n_kv = cfg["vocab_size"], cfg["seq_len"], cfg["n_heads"], cfg["n_kv_heads"]
    head_dim = dim // n_heads
    kv_dim = n_kv * head_dim

    shapes = [
        ("token_embedding", (vocab, dim)),
        ("rms_att", (n_layers, dim)),
        ("wq", (n_layers, dim, dim)),
        ("wk", (n_layers, kv_dim, dim)),
        ("wv", (n_layers, kv_dim, dim)),
        ("wo", (n_layers, dim, dim)),
        ("rms_ffn", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_cis_real", (seq_len, head_dim // 2)),
        ("freq_cis_imag", (seq_len, head_dim // 2)),
    ]
    if not cfg["shared_classifier"]:
        shapes.append(("wcls", (vocab, dim)))
    n_floats = sum(int(np.prod(s)) for _, s in shapes)
    if len(data) != 28 + 4 * n_floats:
        raise ValueError(f"{path}: {len(data)} bytes, expected {28 + 4 * n_floats} for header {cfg}")

    flat = np.frombuffer(data, dtype="<f4", offset=28)
    raw, pos = {}, 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        raw[name] = flat[pos : pos + size].reshape(shape)
        pos += size

    t = {"model.embed_tokens.weight": raw["token_embedding"], "model.norm.weight": raw["rms_final"]}
    if not cfg["shared_classifier"]:
        t["lm_head.weight"] = raw["wcls"]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = raw["rms_att"][i]
        t[p + "self_attn.q_proj.weight"] = interleaved_to_half(raw["wq"][i], n_heads)
        t[p + "self_attn.k_proj.weight"] = interleaved_to_half(raw["wk"][i], n_kv)
        t[p + "self_attn.v_proj.weight"] = raw["wv"][i]
        t[p + "self_attn.o_proj.weight"] = raw["wo"][i]
        t[p + "post_attention_layernorm.weight"] = raw["rms_ffn"][i]
        t[p + "mlp.gate_proj.weight"] = raw["w1"][i]
        t[p + "mlp.up_proj.weight"] = raw["w3"][i]
        t[p + "mlp.down_proj.weight"] = raw["w2"][i]
    return cfg, {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k rows so RoPE on pairs (2i, 2i+1) becomes HF's rotate_half on pairs (i, i + d/2)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def read_tokenizer(path: Path, vocab_size: int) -> list[tuple[str, float]]:
    """Read a llama2.c tokenizer .bin as (piece, score) pairs; pieces are UTF-8 text."""
    data = path.read_bytes()
    pos, pieces = 4, []  # int32 max_token_length first
    for _ in range(vocab_size):
        score, n = struct.unpack_from("<fi", data, pos)
        pieces.append((data[pos + 8 : pos + 8 + n].decode("utf-8"), score))
        pos += 8 + n
    if pos != len(data):
        raise ValueError(f"{path}: {len(data) - pos} trailing bytes after {vocab_size} pieces")
    return pieces


def build_tokenizer(pieces: list[tuple[str, float]]) -> Tokenizer:
    """A sentencepiece-style byte-fallback BPE whose merge order is llama2.c's greedy best-score order."""
    expected = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(N_BYTES)]
    first_normal = len(expected)
    got = [pieces[0][0], pieces[1][0].strip("\n"), pieces[2][0].strip("\n")]
    got += [p for p, _ in pieces[len(SPECIALS) : first_normal]]
    if got != expected:
        raise ValueError("tokenizer does not start with <unk>, <s>, </s> and the 256 byte pieces")

    vocab = {tok: i for i, tok in enumerate(expected)}
    scores = {}
    for i, (piece, score) in enumerate(pieces[first_normal:], start=first_normal):
        tok = piece.replace(" ", SPACE)
        if tok in vocab:
            raise ValueError(f"duplicate piece {piece!r}")
        vocab[tok], scores[tok] = i, score

    # llama2.c merges any adjacent pair whose concatenation is a piece, best score first: list every
    # split of every multi-character piece, ordered by the merged piece's score.
    merges = []
    for tok, score in scores.items():
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in scores and right in scores:
                merges.append((-score, vocab[tok], vocab[left], vocab[right], left, right))
            elif (left in vocab and left not in scores) or (right in vocab and right not in scores):
                raise ValueError(f"piece {tok!r} splits into a special or byte piece")
    merges.sort()

    tok = Tokenizer(BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token="<unk>",
                        fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([
        decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def hf_config(cfg: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["dim"],
        "intermediate_size": cfg["hidden_dim"],
        "num_hidden_layers": cfg["n_layers"],
        "num_attention_heads": cfg["n_heads"],
        "num_key_value_heads": cfg["n_kv_heads"],
        "head_dim": cfg["dim"] // cfg["n_heads"],
        "max_position_embeddings": cfg["seq_len"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg["shared_classifier"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
    }


def tokenizer_config(seq_len: int) -> dict:
    added = {str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    return {
        # The generic class loads tokenizer.json as written; the Llama class would rebuild its own pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # llama2.c reads "<s>" in text as three characters, not as the BOS token.
        "split_special_tokens": True,
        "model_max_length": seq_len,
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def readme(checkpoint: Path, tokenizer: Path, out: Path, cfg: dict) -> str:
    shown = out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out
    lines = [
        "# stories260K (demo model)",
        "",
        "A 260K-parameter Llama trained on TinyStories by llama2.c, converted to Hugging Face Llama format",
        "(fp32 safetensors, tied embeddings, byte-fallback BPE tokenizer with 512 pieces).",
        "",
        "## Sources",
        "",
    ]
    for label, path in (("checkpoint", checkpoint), ("tokenizer", tokenizer)):
        digest = sha256(path)
        origin = KNOWN_SOURCES.get(digest, "not one of the known shared copies; origin unknown")
        lines += [f"- {label}: `{path.name}`, sha256 `{digest}`", f"  - origin: {origin}"]
    lines += [
        "",
        "## Conversion",
        "",
        "```",
        f"python scripts/convert_llama2c.py --checkpoint {checkpoint} --tokenizer {tokenizer} --out {shown}",
        "```",
        "",
        f"Header: {', '.join(f'{k}={cfg[k]}' for k in HEADER_FIELDS)}; shared classifier: "
        f"{cfg['shared_classifier']}.",
        "q/k projection rows are reordered from llama2.c's interleaved RoPE pairs to HF's rotate_half.",
        "The tokenizer stores ' ' as '\u2581' like sentencepiece, so a literal U+2581 in input text reads as",
        "a space (run.c would byte-fall back); other text without NUL encodes and decodes as run.c does.",
        "Greedy decoding from BOS for 200 tokens reproduces llama2.c's reference story "
        "(tests/test_demo_model.py).",
        "",
        "llama2.c ends a story by sampling BOS (id 1), not EOS, so generation_config.json stops on both.",
        "",
    ]
    return "\n".join(lines)


def convert(checkpoint: Path, tokenizer: Path, out: Path) -> None:
    cfg, tensors = read_checkpoint(checkpoint)
    pieces = read_tokenizer(tokenizer, cfg["vocab_size"])
    tok = build_tokenizer(pieces)

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save(str(tmp / "tokenizer.json"))
        files = {
            "config.json": hf_config(cfg),
            "tokenizer_config.json": tokenizer_config(cfg["seq_len"]),
            "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
            "generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 1]},
        }
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        (tmp / "README.md").write_text(readme(checkpoint, tokenizer, out, cfg))
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    convert(args.checkpoint, args.tokenizer, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
