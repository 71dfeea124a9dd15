"""The embedded stories260K demo model behaves exactly like llama2.c: same token ids, same greedy story."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from nvllm.assets import demo_model_path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_CANDIDATES = [REPO_ROOT.parent / "shared" / "data", Path("/work/shared/data")]
TOK_REL = Path("models/stories260K/tok512.bin")
BOS = 1

# From karpathy/llama2.c test_all.py (`expected_stdout`, commit 65c899314ca63449d4edb1128363d7485bdbbcdf):
# run.c with stories260K.bin + tok512.bin, temperature 0, -n 200.
EXPECTED_STORY = (
    'Once upon a time, there was a little girl named Lily. She loved to play outside in the park. '
    'One day, she saw a big, red ball. She wanted to play with it, but it was too high.\n'
    'Lily\'s mom said, "Lily, let\'s go to the park." Lily was sad and didn\'t know what to do. '
    'She said, "I want to play with your ball, but I can\'t find it."\n'
    'Lily was sad and didn\'t know what to do. She said, "I\'m sorry, Lily. I didn\'t know what to do."\n'
    'Lily didn\'t want to help her mom, so she'
)

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    'Tim said, "Let\'s play!" Lily smiled; they ran (fast) to the park...',
    "She had 3 cats, 12 dogs and 1,024 fish in 2023.",
    "line one\nline two\n\nline four\r\n",
    "café — 東京",
    "naïve “quotes” ’ and emoji 🙂 ok",
    "tabs\tand  double  spaces   end ",
    "<s> is not BOS and </s> is not EOS <unk>",
    "",
    " ",
    "  ",
    "\n",
    "a",
    " leading space",
    EXPECTED_STORY,
]
TEXT_IDS = [repr(t[:24]) for t in TEXTS]


# ---- a small, separate Python port of llama2.c's tokenizer (run.c encode/decode) ----

def shared_tok512() -> Path:
    for root in SHARED_CANDIDATES:
        if (root / TOK_REL).is_file():
            return root / TOK_REL
    pytest.skip("shared data folder with models/stories260K/tok512.bin is absent")


def load_llama2c_vocab(path: Path, vocab_size: int = 512) -> tuple[list[bytes], list[float]]:
    data = path.read_bytes()
    pieces, scores, pos = [], [], 4
    for _ in range(vocab_size):
        score, n = struct.unpack_from("<fi", data, pos)
        pieces.append(data[pos + 8 : pos + 8 + n])
        scores.append(score)
        pos += 8 + n
    return pieces, scores


def llama2c_encode(text: str, pieces: list[bytes], scores: list[float], bos: bool = True) -> list[int]:
    lookup = {p: i for i, p in enumerate(pieces)}
    tokens = [BOS] if bos else []
    if text:
        tokens.append(lookup[b" "])  # dummy prefix
    for ch in text:  # one code point at a time, byte fallback at id byte + 3
        b = ch.encode("utf-8")
        tokens.extend([lookup[b]] if b in lookup else [x + 3 for x in b])
    while True:  # merge the adjacent pair whose merged piece scores best (leftmost on ties)
        best = None
        for i in range(len(tokens) - 1):
            tid = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if tid is not None and (best is None or scores[tid] > best[0]):
                best = (scores[tid], i, tid)
        if best is None:
            return tokens
        _, i, tid = best
        tokens[i : i + 2] = [tid]


def llama2c_decode(ids: list[int], pieces: list[bytes]) -> str:
    out, prev = b"", None
    for t in ids:
        if t == BOS:
            prev = t
            continue
        piece = pieces[t]
        if prev == BOS and piece.startswith(b" "):
            piece = piece[1:]
        if piece.startswith(b"<0x") and piece.endswith(b">") and len(piece) == 6:
            piece = bytes([int(piece[3:5], 16)])
        out, prev = out + piece, t
    return out.decode("utf-8")


# ---- fixtures ----

@pytest.fixture(scope="module")
def hf_tok():
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def vocab():
    return load_llama2c_vocab(shared_tok512())


# ---- tokenizer ----

@pytest.mark.parametrize("text", TEXTS, ids=TEXT_IDS)
def test_encode_matches_llama2c(hf_tok, vocab, text):
    pieces, scores = vocab
    assert hf_tok(text).input_ids == llama2c_encode(text, pieces, scores)
    assert hf_tok(text, add_special_tokens=False).input_ids == llama2c_encode(text, pieces, scores, bos=False)


@pytest.mark.parametrize("text", TEXTS, ids=TEXT_IDS)
def test_decode_roundtrip(hf_tok, text):
    ids = hf_tok(text).input_ids
    assert ids[0] == BOS
    assert hf_tok.decode(ids, skip_special_tokens=True) == text


def test_decode_matches_llama2c(hf_tok, vocab):
    pieces, _ = vocab
    for text in TEXTS:
        ids = hf_tok(text).input_ids
        assert hf_tok.decode(ids, skip_special_tokens=True) == llama2c_decode(ids, pieces) == text


def test_encode_matches_llama2c_fuzz(hf_tok, vocab):
    """Random strings built from vocabulary pieces, spaces and odd characters stress the merge order."""
    pieces, scores = vocab
    parts = [p.decode("utf-8") for p in pieces[259:]] + [" ", "  ", "\n", "é", "東", "\u00a0", "<", "0x41>"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 12)))
        assert hf_tok(text).input_ids == llama2c_encode(text, pieces, scores), repr(text)


def test_special_tokens(hf_tok):
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id) == (1, 2, 0)
    assert len(hf_tok) == 512
    assert hf_tok.convert_ids_to_tokens([3, 13, 258]) == ["<0x00>", "<0x0A>", "<0xFF>"]


# ---- model ----

@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()


def test_model_shape(model):
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 172, 5)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (8, 4, 512)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps) == (512, 1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.tie_word_embeddings) == (1, 2, True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 260_032  # tied head counted once


def test_greedy_story_matches_llama2c(model, hf_tok):
    """run.c -n 200 forwards positions 0..199 (BOS first) and prints each argmax: 200 new tokens."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([[BOS]]), max_new_tokens=200, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    ids = out[0].tolist()
    assert len(ids) == 1 + 200
    assert BOS not in ids[1:]
    assert hf_tok.decode(ids, skip_special_tokens=True) == EXPECTED_STORY


def test_generation_stops_at_bos(model, hf_tok):
    """llama2.c ends a story when it samples BOS; generation_config.json stops on BOS as well as EOS."""
    with torch.inference_mode():
        ids = model.generate(torch.tensor([[BOS]]), max_new_tokens=500, do_sample=False, pad_token_id=0)[0]
    ids = ids.tolist()
    assert ids[-1] == BOS and BOS not in ids[1:-1] and 2 not in ids
    assert 200 < len(ids) < 501
    assert hf_tok.decode(ids, skip_special_tokens=True).startswith(EXPECTED_STORY)


def test_known_divergence_lower_one_eighth_block(hf_tok, vocab):
    """U+2581 in input text: sentencepiece (and this tokenizer) read it as a space; run.c byte-falls back."""
    pieces, scores = vocab
    assert hf_tok("a\u2581b").input_ids == hf_tok("a b").input_ids
    assert llama2c_encode("a\u2581b", pieces, scores) == [BOS, 261, 0xE2 + 3, 0x96 + 3, 0x81 + 3, 430]
