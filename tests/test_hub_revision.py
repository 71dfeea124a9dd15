"""Hub ids at a revision (vLLM's --revision / --tokenizer-revision), served from a local Hub cache laid out as
huggingface_hub writes it (refs/<branch or tag> → snapshots/<commit>) with the network off, so the real
snapshot_download resolves them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from nvllm import SamplingParams
from tests.conftest import build_tiny_model, make_llm

REPO = "nvllm-test/tiny-llama"
MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """Two commits of one repo: main (seed 0) and tag v2 (seed 1, other weights)."""
    root = tmp_path_factory.mktemp("hub")
    built = {}
    repo_dir = root / "cache" / f"models--{REPO.replace('/', '--')}"
    for commit, seed, ref in ((MAIN, 0, "main"), (V2, 1, "v2")):
        built[ref] = build_tiny_model("llama", root / ref, seed=seed)
        shutil.copytree(built[ref], repo_dir / "snapshots" / commit)
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return root / "cache", built


@pytest.fixture
def offline(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache[0]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def _greedy(llm) -> list[int]:
    out = llm.generate([[1, 45, 300, 12]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_revision_picks_the_commit(offline):
    _, built = offline
    for revision, ref in ((None, "main"), ("v2", "v2"), (V2, "v2"), ("main", "main")):
        llm = make_llm(REPO, revision=revision)
        assert llm.engine.config.model.endswith(MAIN if ref == "main" else V2)
        assert llm.engine.config.tokenizer == llm.engine.config.model  # the tokenizer follows the model's revision
        assert _greedy(llm) == _greedy(make_llm(str(built[ref])))
        llm.close()


def test_tokenizer_revision_apart(offline):
    llm = make_llm(REPO, revision="v2", tokenizer=REPO, tokenizer_revision="main")
    assert llm.engine.config.model.endswith(V2) and llm.engine.config.tokenizer.endswith(MAIN)


def test_unknown_revision_and_revision_of_a_directory(offline):
    from nvllm.config import ConfigError

    with pytest.raises(ConfigError, match=f"'{REPO}' at revision 'nope' could not be fetched from the Hugging "
                                          "Face Hub"):
        make_llm(REPO, revision="nope")
    with pytest.raises(ConfigError, match="revision must be a non-empty string"):
        make_llm(REPO, revision="")
    local = str(offline[1]["v2"])
    assert make_llm(local, revision="main").engine.config.model == local  # as vLLM: nothing to select


def test_quantize_and_generate_commands_take_a_revision(offline, tmp_path):
    cache, built = offline
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "nvllm.cli", "quantize", "--model", REPO, "--revision", "v2",
                        "--method", "rtn", "--group-size", "32", "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    reference = tmp_path / "ref"
    r = subprocess.run([sys.executable, "-m", "nvllm.cli", "quantize", "--model", str(built["v2"]), "--method", "rtn",
                        "--group-size", "32", "--out", str(reference), "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    r = subprocess.run([sys.executable, "-m", "nvllm.cli", "generate", "--model", REPO, "--revision", "nope", "Hi"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "at revision 'nope' could not be fetched" in r.stderr and "Traceback" not in r.stderr
