"""`nvllm quantize` as a user runs it: the happy path (progress, table, summary, a servable directory),
recipes, calibration sources, and every bad input ending in one clear line and a non-zero exit."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nvllm.assets import demo_model_path
from nvllm.cli import app
from nvllm.engine.llm_engine import load_tokenizer
from nvllm.models import hub
from nvllm.quant import calibration as C
from nvllm.quant.recipe import RecipeError, build_config
from tests.conftest import REPO

FAST = ["--calib-dataset", "calib", "--calib-samples", "4", "--calib-seqlen", "64", "--no-progress"]


def run(*args: str):
    result = CliRunner().invoke(app, ["quantize", *args], env={"COLUMNS": "200"})
    return result.exit_code, " ".join(result.output.split())


def test_quantize_cli_writes_a_servable_model(tmp_path):
    code, out = run("--method", "gptq", "--group-size", "32", "--out", str(tmp_path / "q"), *FAST)
    assert code == 0, out
    assert "relative reconstruction error" in out and "layer output" in out and "windows)" in out
    assert "first 16" not in out  # FAST calibrates on 4 windows: every one counted
    assert "method gptq, 4-bit, group size 32, symmetric; format GPTQ v1" in out
    assert "kept in full precision in every layer: mlp.down_proj (group size 32 does not divide its input size 172)" in out
    assert "size 1020.50 KiB →" in out and f"written to {tmp_path / 'q'}" in out
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "gptq"
    # the MLP stays dense (172 fits no packing): vLLM reads the dynamic exclusions, transformers / optimum the
    # modules to quantize (GPTQConfig's modules_in_block_to_quantize: a list of lists of names inside a layer)
    blocks = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]]
    assert cfg["quantization_config"]["modules_in_block_to_quantize"] == blocks


def test_recipe_and_flag_override(tmp_path):
    code, out = run("--recipe", str(REPO / "recipes" / "awq-w4g128.yaml"), "--group-size", "64",
                    "--out", str(tmp_path / "q"), *FAST)
    assert code == 0, out
    assert "method awq, 4-bit, group size 64, zero point; format AWQ-GEMM" in out


def test_shipped_recipes_are_named_alone_from_any_directory(tmp_path, monkeypatch):
    """The recipes ship in the package: `--recipe gptq-w4g128` (or the README's recipes/gptq-w4g128.yaml) finds them
    from any directory, as an installed wheel has no checkout beside it; a name that is neither is one line listing
    them, and a path with brackets is printed as written."""
    from nvllm.quant.recipe import load_recipe

    monkeypatch.chdir(tmp_path)
    want = load_recipe(str(REPO / "recipes" / "gptq-w4g128.yaml"))
    assert load_recipe("gptq-w4g128") == load_recipe("gptq-w4g128.yaml") == load_recipe("recipes/gptq-w4g128.yaml")
    assert load_recipe("gptq-w4g128") == want
    (tmp_path / "gptq-w4g128").mkdir()  # a folder of that name (an earlier --out) hides nothing
    assert load_recipe("gptq-w4g128") == want
    code, out = run("--recipe", "awq-w4g128", "--group-size", "64", "--out", str(tmp_path / "q"), *FAST)
    assert code == 0 and "method awq, 4-bit, group size 64, zero point; format AWQ-GEMM" in out, out
    code, out = run("--recipe", "gptq-w5", "--out", str(tmp_path / "q2"))
    assert code == 2 and "recipe not found: gptq-w5 (shipped recipes: awq-w4g128, fp8-block128," in out, out
    code, out = run("--recipe", "mine[v2].yaml", "--out", str(tmp_path / "q2"))
    assert code == 2 and "recipe not found: mine[v2].yaml" in out, out


def test_shipped_recipes_validate(tmp_path):
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(recipes) >= 4
    for r in recipes:
        cfg = build_config(str(r))
        assert cfg.method in ("awq", "gptq", "rtn", "fp8") and cfg.bits in (4, 8)
    r = tmp_path / "r.yaml"
    r.write_text("method: rtn\nmax_shard_size: 2GB\n")
    assert build_config(str(r)).max_shard_size == "2GB"
    assert build_config(str(r), max_shard_size="1GB").max_shard_size == "1GB"      # the flag over the recipe
    r.write_text("method: awq\ncalibration: {dataset: HuggingFaceH4/ultrachat_200k, split: train_sft, column: "
                 "messages}\n")
    cfg = build_config(str(r), calib_split="test_sft", calib_config="default")
    assert (cfg.calib_dataset, cfg.calib_split, cfg.calib_column, cfg.calib_config) == (
        "HuggingFaceH4/ultrachat_200k", "test_sft", "messages", "default")


@pytest.mark.parametrize("body, message", [
    ("method: gptq\nbitz: 4\n", "unknown key 'bitz'"),
    ("method: gptq\nbits: four\n", "bits must be an integer, got 'four'"),
    ("method: gptq\ngptq: {damp: 0.1}\n", "unknown key gptq.damp"),
    ("- gptq\n", "expected a mapping"),
    ("method: rtn\ngptq: {damp_percent: 0.5}\n", "gptq.damp_percent applies to --method gptq, not rtn"),
    ("method: gptq\nawq: {n_grid: 3}\n", "awq.n_grid applies to --method awq, not gptq"),
    ("method: rtn\ncalibration: {seed: 100000000000000000000000}\n", r"seed must be in \[0, 2\^63\)"),
    ("method: rtn\nmax_shard_size: 0\n", "--max-shard-size must be a positive size such as 5GB"),
    ("method: rtn\nbits: 4\ngptq: {block_size: 64}\nbits: 8\n", "'bits' is set twice"),
    ("method: gptq\ngptq: {block_size: 64, block_size: 32}\n", "'block_size' is set twice"),
])
def test_bad_recipes(tmp_path, body, message):
    p = tmp_path / "r.yaml"
    p.write_text(body)
    with pytest.raises(RecipeError, match=message):
        build_config(str(p))


def test_a_recipes_settings_are_named_as_the_recipes(tmp_path):
    """A setting that came from the recipe, not a flag, is said to: the user passed no --desc-act here."""
    with pytest.raises(RecipeError, match=r"applies to GPTQ only \(recipe .*gptq-w4g128-actorder.yaml sets .*desc_act"):
        build_config(str(REPO / "recipes" / "gptq-w4g128-actorder.yaml"), method="rtn")
    p = tmp_path / "r.yaml"
    p.write_text("method: rtn\nmax_shard_size: 1000\n")   # bytes, as save_pretrained takes an integer
    assert build_config(str(p)).max_shard_size == "1000"


def test_unreadable_recipe_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match=r"^cannot read recipe .*: \[Errno 21\] Is a directory"):
        build_config(str(tmp_path))
    # an error without a message is named by its type, not an IndexError from its empty text
    def fail(*a, **k):
        raise PermissionError()
    monkeypatch.setattr("builtins.open", fail)
    with pytest.raises(RecipeError, match=r"cannot read recipe r\.yaml: PermissionError$"):
        build_config("r.yaml")


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qd") / "q"
    code, text = run("--method", "rtn", "--group-size", "32", "--out", str(out), *FAST)
    assert code == 0, text
    return out


@pytest.mark.parametrize("args, message", [
    (["--method", "fp4"], "unknown method 'fp4'; choose awq, gptq, rtn or fp8"),
    (["--method", "gptq", "--bits", "3"], "bits must be 4 or 8, got 3"),
    (["--method", "awq", "--bits", "8"], "AWQ quantizes to 4 bits only"),
    (["--method", "gptq", "--group-size", "48"], "group size 48 fits none of the model's linears (input sizes "
                                               "64, 172; group size 48 does not divide its input size 64); "
                                               "choose a group size that divides the hidden size 64, e.g. "
                                               "--group-size 64"),
    (["--method", "gptq", "--group-size", "0"], "group size must be a positive integer or -1"),
    (["--method", "awq", "--sym"], "AWQ quantizes with a zero point"),
    (["--method", "rtn", "--desc-act"], "--desc-act (act-order) applies to GPTQ only"),
    (["--method", "gptq", "--group-size", "32", "--calib-dataset", "/no/such/file.jsonl"], "calibration file not found: /no/such/file.jsonl"),
    (["--method", "gptq", "--model", "/no/such/model"], "model directory not found: /no/such/model"),
    (["--method", "gptq", "--recipe", "/no/such.yaml"], "recipe not found: /no/such.yaml"),
    (["--group-size", "32"], "choose a method"),
    (["--method", "rtn", "--max-shard-size", "5XB"], "--max-shard-size must be a positive size such as 5GB or 500MB "
                                                     "(or a number of bytes), got '5XB'"),
    (["--method", "fp8", "--max-shard-size", "0GB"], "--max-shard-size must be a positive size"),
    (["--method", "rtn", "--max-shard-size", "infGB"], "--max-shard-size must be a positive size"),
    (["--method", "rtn", "--max-shard-size", "1e-12GB"], "--max-shard-size must be a positive size"),
    (["--method", "rtn", "--group-size", "32", "--calib-dataset", ""], "--calib-dataset is empty"),
    (["--method", "rtn", "--group-size", "32", "--calib-samples", str(10**12), "--calib-seqlen", "32"],
     f"--calib-samples {10**12} × --calib-seqlen 32 keeps"),        # it filled the machine's memory, silently
    (["--method", "fp8", "--group-size", "100000"], "FP8 blocks of 100000 × 100000 are larger than every linear "
                                                    "of the model (at most 172 wide)"),   # an allocator traceback
    (["--method", "rtn", "--group-size", "32", "--model", ""], "--model is empty"),   # it quantized the demo model
])
def test_bad_input(tmp_path, args, message):
    code, out = run(*args, "--out", str(tmp_path / "out"), "--no-progress")
    assert code == 2, out
    assert message in out and "Traceback" not in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["rtn", "fp8"])
def test_max_shard_size_splits_the_weights(tmp_path, method):
    """Past ``--max-shard-size`` the weights go into numbered shards with an index, as ``save_pretrained`` writes
    them: the same tensors as the one-file checkpoint, and the engine reads them back to the same logprobs."""
    from safetensors.torch import load_file

    from nvllm import LLM, SamplingParams

    args = ["--method", "rtn", "--group-size", "32", *FAST] if method == "rtn" else \
        ["--method", "fp8", "--group-size", "64", "--no-progress"]
    code, out = run(*args, "--out", str(tmp_path / "one"))
    assert code == 0, out
    code, out = run(*args, "--out", str(tmp_path / "split"), "--max-shard-size", "300KB")
    assert code == 0, out
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "split").glob("*.safetensors"))
    assert len(files) >= 2 and files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in
                                         range(1, len(files) + 1)]
    assert sorted(set(index["weight_map"].values())) == files
    assert all((tmp_path / "split" / f).stat().st_size <= 300_000 + 70_000 for f in files)   # a tensor past it
    one = load_file(tmp_path / "one" / "model.safetensors")
    split = {}
    for f in files:
        split.update(load_file(tmp_path / "split" / f))
    assert split.keys() == one.keys() == index["weight_map"].keys()
    assert all(torch.equal(split[k], one[k]) for k in one)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in one.values())
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    got = [LLM(str(tmp_path / d), device="cpu", log_stats_interval=0).generate(["Once upon a time"], params,
                                                                               use_tqdm=False)[0].outputs[0]
           for d in ("one", "split")]
    assert got[0].token_ids == got[1].token_ids
    assert [lp[t].logprob for lp, t in zip(got[0].logprobs, got[0].token_ids)] == \
        [lp[t].logprob for lp, t in zip(got[1].logprobs, got[1].token_ids)]


def test_unreadable_calibration_files_are_one_line(tmp_path):
    whole = gzip.compress(b'{"text": "Once upon a time there was a cat."}\n' * 50)
    for name, data in (("garbage.jsonl.gz", b"not gzip at all"), ("cut.jsonl.gz", whole[:len(whole) // 2])):
        (tmp_path / name).write_bytes(data)
        code, out = run("--method", "rtn", "--group-size", "32", "--calib-dataset", str(tmp_path / name),
                        "--out", str(tmp_path / "q"), "--no-progress")
        assert code == 2 and f"cannot read calibration file {tmp_path / name}: " in out, out
        assert "Traceback" not in out and "Aborted" not in out and not (tmp_path / "q").exists()
    (tmp_path / "r.yaml").write_bytes("method: rtn # caf\xe9\n".encode("latin-1"))
    code, out = run("--recipe", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "q"), "--no-progress")
    assert code == 2 and f"cannot read recipe {tmp_path / 'r.yaml'}: " in out, out


def test_a_hub_id_is_fetched_or_named(tmp_path, monkeypatch):
    """--model takes a Hub id as the other commands do; offline the error names the Hub, not a missing folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out = run("--method", "rtn", "--model", "Qwen/Qwen2.5-0.5B", "--out", str(tmp_path / "q"), *FAST)
    assert code == 2 and "'Qwen/Qwen2.5-0.5B' could not be fetched from the Hugging Face Hub" in out, out


def test_already_quantized_and_existing_output(tmp_path, quantized_dir):
    code, out = run("--method", "gptq", "--model", str(quantized_dir), "--out", str(tmp_path / "again"), *FAST)
    assert code == 2 and "is already quantized (gptq); quantize the full-precision model" in out
    code, out = run("--method", "rtn", "--group-size", "32", "--out", str(quantized_dir), *FAST)
    assert code == 2 and "already exists (pass --overwrite to replace it)" in out
    code, out = run("--method", "rtn", "--group-size", "32", "--out", str(quantized_dir), "--overwrite", *FAST)
    assert code == 0, out


def test_overwrite_replaces_a_model_directory_only(tmp_path, monkeypatch):
    """--overwrite replaces an earlier checkpoint (or an empty directory), never a folder of other things: --out
    ~/models --overwrite would have deleted every model in it. A Hub --model is not fetched before --out is
    checked."""
    folder = tmp_path / "models"
    (folder / "other-model").mkdir(parents=True)
    (folder / "notes.txt").write_text("keep")
    code, text = run("--method", "rtn", "--group-size", "32", "--out", str(folder), "--overwrite", *FAST)
    assert code == 2 and "holds no config.json" in text and "Traceback" not in text, text
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "other-model"]
    (tmp_path / "empty").mkdir()
    code, text = run("--method", "rtn", "--group-size", "32", "--out", str(tmp_path / "empty"), "--overwrite", *FAST)
    assert code == 0 and (tmp_path / "empty" / "config.json").is_file(), text

    import huggingface_hub

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: fetched.append(kw) or str(folder))
    code, text = run("--method", "rtn", "--model", "Qwen/Qwen2.5-72B", "--out", str(tmp_path / "empty"), *FAST)
    assert code == 2 and "already exists" in text and not fetched, text


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    def full(path, entries, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr("nvllm.quant.shard_writer.write_shard", full)
    code, text = run("--method", "rtn", "--group-size", "32", "--out", str(tmp_path / "q"), *FAST)
    assert code == 2 and "No space left on device" in text and "Traceback" not in text, text
    assert list(tmp_path.iterdir()) == []


def test_output_never_replaces_the_model(tmp_path):
    """--out that is the model through a link, or a folder holding it, is refused before anything is written, even
    with --overwrite; so is an output no one can create."""
    src = tmp_path / "par" / "m"
    shutil.copytree(demo_model_path(), src)
    (tmp_path / "par" / "notes.txt").write_text("x")
    (tmp_path / "link").symlink_to(src)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in (tmp_path / "link", tmp_path / "par", src):
        code, text = run("--method", "rtn", "--group-size", "32", "--model", str(src), "--out", str(out),
                         "--overwrite", *FAST)
        assert code == 2 and "is the model directory or holds it" in text and "Traceback" not in text, text
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    (tmp_path / "file").write_text("x")
    code, text = run("--method", "rtn", "--group-size", "32", "--out", str(tmp_path / "file" / "q"), *FAST)
    assert code == 2 and f"{tmp_path / 'file'} is not a writable directory" in text, text


def test_an_empty_or_enclosing_output_never_replaces_the_current_directory(tmp_path, monkeypatch):
    """--out "" resolves to the current directory, and "." or a parent of it would replace what the user stands in:
    refused before anything is written, even with --overwrite."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    for out, overwrite in (("", []), ("", ["--overwrite"]), (".", ["--overwrite"]), ("..", ["--overwrite"])):
        code, text = run("--method", "rtn", "--group-size", "32", "--out", out, *overwrite, *FAST)
        assert code == 2 and "Traceback" not in text, text
        assert ("--out is empty" in text) if out == "" else ("is the current directory or holds it" in text)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["notes.txt", "work"]


_TERMINATED_WHILE_WRITING = """
import os, signal, sys, time
import nvllm.quant.shard_writer
from nvllm.cli import app

def write_shard(path, entries, data):  # half a weights file, then the scheduler's SIGTERM
    open(path, "wb").write(b"x" * 1000)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

nvllm.quant.shard_writer.write_shard = write_shard
app(sys.argv[1:])
"""


def test_sigterm_while_writing_leaves_nothing(tmp_path):
    """SIGTERM (a job scheduler's stop) in the middle of writing the checkpoint: the temporary directory is removed,
    as on Ctrl-C, with the parent directory the run made for it, and the command exits 143."""
    import subprocess
    import sys

    out = tmp_path / "out" / "q"
    proc = subprocess.run([sys.executable, "-c", _TERMINATED_WHILE_WRITING, "quantize", "--method", "rtn",
                           "--group-size", "32", "--out", str(out), *FAST], capture_output=True, text=True,
                          timeout=300, cwd=str(REPO))
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


def test_calibration_sources(tmp_path, monkeypatch):
    tok = load_tokenizer(demo_model_path())
    docs = [{"text": f"Once upon a time there was a cat number {i}."} for i in range(30)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    with gzip.open(tmp_path / "d.json.gz", "wt") as f:
        f.write("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "d.txt").write_text(" ".join(d["text"] for d in docs))
    for name in ("d.jsonl", "d.json.gz", "d.txt"):
        texts, where = C.load_texts(str(tmp_path / name))
        ids = C.calibration_windows(tok, texts, 3, 16, seed=0)
        assert ids.shape == (3, 16)
        assert C.calibration_windows(tok, texts, 3, 16, seed=0).equal(ids)
        assert not C.calibration_windows(tok, texts, 3, 16, seed=1).equal(ids)
    with pytest.raises(C.CalibrationError, match="needs at least that many"):
        C.calibration_windows(tok, ["tiny"], 1, 512, seed=0)
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(C.CalibrationError, match="line 1 is not JSON"):
        C.load_texts(str(tmp_path / "bad.jsonl"))
    # c4 without the datasets package or the network: the shipped sample, and the note says why
    monkeypatch.setattr(C, "_c4_texts", lambda: (None, "huggingface.co is not reachable"))
    texts, where = C.load_texts("c4")
    assert len(texts) == 150 and "c4 unavailable (huggingface.co is not reachable)" in where
    assert Path(C.SHIPPED_SAMPLE).stat().st_size <= 300_000


def test_calibration_from_a_dataset_folder_and_from_conversations(tmp_path):
    """--calib-dataset takes a dataset folder (or a Hub id) that `datasets` reads, --calib-split / --calib-column
    choosing the part as AutoAWQ's split / text_column; a messages column (or a file's "messages" objects) holds
    conversations, which the model's chat template renders before tokenizing."""
    rows = [{"body": f"Once upon a time there was a cat number {i}.",
             "messages": [{"role": "user", "content": f"Tell me about cat {i}."},
                          {"role": "assistant", "content": "It liked milk."}]} for i in range(30)]
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    docs, where = C.load_texts(str(folder), column="body")
    assert docs == [r["body"] for r in rows] and where == f"{folder}, split train, column body via datasets"
    docs, where = C.load_texts(str(folder))  # no text column: the conversations
    assert docs == [r["messages"] for r in rows] and where.endswith("column messages via datasets")
    # a folder save_to_disk wrote (a DatasetDict: its splits), nulls of a nullable column skipped
    import datasets
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["one cat", None, "two cats"]}),
                          "test": datasets.Dataset.from_dict({"text": ["a dog"]})}).save_to_disk(str(saved))
    assert C.load_texts(str(saved))[0] == ["one cat", "two cats"]
    assert C.load_texts(str(saved), split="test")[0] == ["a dog"]
    with pytest.raises(C.CalibrationError, match=r"has no split 'validation' \(it has train, test\): pass "
                                                 r"--calib-split"):
        C.load_texts(str(saved), split="validation")
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": r["messages"]}) for r in rows))
    assert C.load_texts(str(tmp_path / "chat.jsonl"))[0] == docs
    # ShareGPT's files (the ones `nvllm bench` reads): {"from", "value"} turns become messages
    sharegpt = [{"id": str(i), "conversations": [{"from": "human", "value": f"Tell me about cat {i}."},
                                                 {"from": "gpt", "value": "It liked milk."}]} for i in range(30)]
    (tmp_path / "sharegpt.json").write_text(json.dumps(sharegpt))
    assert C.load_texts(str(tmp_path / "sharegpt.json"))[0] == docs
    (tmp_path / "sg").mkdir()
    (tmp_path / "sg" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in sharegpt))
    assert C.load_texts(str(tmp_path / "sg")) == (docs, f"{tmp_path / 'sg'}, split train, column conversations "
                                                        "via datasets")

    tok = load_tokenizer(demo_model_path())
    with pytest.raises(C.CalibrationError, match="no chat template"):
        C.calibration_windows(tok, docs, 2, 16, seed=0)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    text = "user: Tell me about cat 0.\nassistant: It liked milk.\n"
    assert C.render(tok, docs[0]) == text
    want = tok(text, add_special_tokens=False)["input_ids"]  # the template's end, no EOS after it
    assert C.calibration_windows(tok, docs[:1], 1, len(want), seed=0)[0].tolist() == want
    assert C.calibration_windows(tok, [text], 1, len(want) + 1, seed=0)[0].tolist() == want + [tok.eos_token_id]

    code, out = run("--method", "rtn", "--group-size", "32", "--calib-dataset", str(folder), "--calib-column",
                    "body", "--calib-samples", "4", "--calib-seqlen", "16", "--no-progress", "--out",
                    str(tmp_path / "q"))
    assert code == 0 and f"calibration tokens from {folder}, split train, column body via datasets" in out, out


def test_bad_calibration_datasets_are_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"body": f"cat {i}", "n": i}) for i in range(8)))
    (tmp_path / "d.jsonl").write_text('{"text": "Once upon a time"}\n')
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    unreachable = "not a local file or folder, and the Hugging Face Hub is not reachable"
    zstd = importlib.util.find_spec("zstandard") is not None
    for args, message in (
            ([str(folder)], f"calibration dataset {folder} has no text, messages or conversations column (it has "
                            "body, n): pass --calib-column"),
            ([str(folder), "--calib-column", "nope"], f"calibration dataset {folder} has no column 'nope'"),
            ([str(folder), "--calib-column", "n"], f"{folder}: row 0 of 'n' is neither text nor a conversation"),
            ([str(folder), "--calib-split", "test"], f"cannot load calibration dataset {folder}, split test: "),
            ([str(tmp_path / "d.jsonl"), "--calib-split", "train"], "--calib-split, --calib-column and "
                                                                     "--calib-config choose the part of a dataset"),
            (["calib", "--calib-column", "text"], "choose the part of a dataset (pileval, wikitext2, a Hub id or a "
                                                  "dataset folder), not of calib"),
            (["pileval"], f"cannot load calibration dataset mit-han-lab/pile-val-backup: {unreachable} (with "
                          "HF_HUB_OFFLINE=1 a copy in the datasets cache is used)" if zstd else
                          "--calib-dataset mit-han-lab/pile-val-backup: its files need the zstandard package: pip "
                          "install zstandard"),
            (["wikitext2", "--calib-config", "wikitext-103-raw-v1"], "cannot load calibration dataset "
                                                                     f"Salesforce/wikitext: {unreachable}"),
            (["someone/some-set"], f"cannot load calibration dataset someone/some-set: {unreachable}"),
            (["./no/such"], "calibration file not found: ./no/such"),     # a mistyped path is not a Hub id
            (["../no-such/set"], "calibration file not found: ../no-such/set")):
        code, out = run("--method", "rtn", "--group-size", "32", "--calib-dataset", *args, "--out",
                        str(tmp_path / "q"), "--no-progress")
        assert code == 2 and message in out and "Traceback" not in out, (args, out)
        assert not (tmp_path / "q").exists()


def test_the_hub_probe_follows_the_endpoint_proxies_and_offline_spellings(monkeypatch):
    """Whether to try the Hub: HF_ENDPOINT's host (a mirror), not huggingface.co; behind a proxy the request decides;
    HF_HUB_OFFLINE as huggingface_hub spells it."""
    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert not hub.hub_reachable(timeout=2)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub.hub_reachable(timeout=2)
    assert not hub.hub_offline()
    for spelling in ("1", "true", "YES", "on"):
        monkeypatch.setenv("HF_HUB_OFFLINE", spelling)
        assert hub.hub_offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert not hub.hub_offline()
