"""Perplexity on WikiText-2, C4 or any text file, through the engine's prompt log-probabilities.

Each document is tokenized and scored exactly as `NvllmLM.loglikelihood_rolling` (lm-eval's hf backend) does it: the
tokenizer's own special tokens (a Llama-style BOS is then the first token, predicted after the BOS prefix, as lm-eval
scores it), disjoint windows of max_length predictions (`NvllmLM.rolling_windows`: every token predicted once, each
conditioned on the tokens of its window before it and on the one token before the window), and

    token_perplexity = exp(-sum log p / tokens)      (every token predicted; the primary number)
    word_perplexity  = exp(-sum log p / words)       byte_perplexity = exp(-sum log p / bytes)
    bits_per_byte    = -sum log p / bytes / ln 2     (words and bytes as lm-eval's wikitext task counts them)

WikiText documents are the articles of wiki.test.raw (split at the " = Title = " headings) passed through
lm-eval's wikitext detokenizer, as lm-eval's `wikitext` task scores them; words and bytes are counted on the
raw article. C4: the "text" field of each record of one file of the folder, a validation shard (c4-validation*)
where there is one, as the established tools score C4; another file: .jsonl/.json(.gz) by its "text" field (JSON lines
or a JSON array), anything else as one plain-text document. A perplexity beyond float range is inf.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from nvllm.config import missing
from nvllm.eval.datafiles import DataError, read_records, read_text, text_fields

PPL_TASKS = ("wikitext", "c4")
_HEADING = re.compile(r"^ = [^=].* = $")


PerplexityError = DataError  # a perplexity source that cannot be found or read (one clear line)


@dataclass
class Corpus:
    name: str
    source: str
    raw: list[str]  # the documents as stored (words and bytes are counted on these)
    scored: list[str] = field(default_factory=list)  # the text actually scored (detokenised for WikiText)

    def __post_init__(self) -> None:
        self.scored = self.scored or list(self.raw)


def is_perplexity_task(name: str) -> bool:
    return name in PPL_TASKS or "/" in name or Path(name).suffix in (".txt", ".raw", ".jsonl", ".json", ".gz")


def split_wikitext(text: str) -> list[str]:
    """The articles of a raw WikiText file (CRLF or LF), each from its top-level heading line on."""
    docs: list[list[str]] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if _HEADING.match(line) or not docs:
            docs.append([])
        docs[-1].append(line)
    pages = ["".join(f"{x}\n" for x in lines).rstrip("\n") + "\n" for lines in docs]
    return [p for p in pages if p.strip()]


def _json_texts(path: Path) -> list[str]:
    texts = [text_fields(r, where, ("text",), "one document a record")["text"] for where, r in read_records(path)]
    if not any(t.strip() for t in texts):
        raise PerplexityError(f"{path} holds no documents")
    return [t for t in texts if t.strip()]


def c4_file(folder: Path) -> Path | None:
    """The C4 shard to score: the first validation shard (c4-validation.00000-of-00008.json.gz, as GPTQ and the
    perplexity scripts after it read), else the first JSON file of the folder."""
    files = sorted({p for pattern in ("*.jsonl", "*.json", "*.jsonl.gz", "*.json.gz") for p in folder.glob(pattern)
                    if p.is_file()})
    return next((p for p in files if "validation" in p.name), files[0] if files else None)


def _first(paths: list[Path]) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


def load_corpus(name: str, data_dir: str | Path | None) -> Corpus:
    """Documents of a perplexity task: `wikitext`, `c4` (under --data-dir) or a file path."""
    root = Path(data_dir) if data_dir else None
    if name == "wikitext":
        from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

        found = root and _first([root / d / "wiki.test.raw" for d in ("wikitext-2-raw", "wikitext-2-raw-v1", ".")])
        if found:
            raw = split_wikitext(read_text(found))
            source = str(found)
        elif root is None:
            raw, source = _hub_wikitext(), "EleutherAI/wikitext_document_level (hub)"
        else:
            raise PerplexityError(f"WikiText-2 not found: expected {root / 'wikitext-2-raw' / 'wiki.test.raw'}")
        return Corpus(name, source, raw, [wikitext_detokenizer({"page": p}) for p in raw])
    if name == "c4":
        if root is None:
            raise PerplexityError("c4 reads local files: pass --data-dir DIR holding c4/*.jsonl (or .json.gz)")
        folder = root / "c4" if (root / "c4").is_dir() else root
        found = c4_file(folder)
        if found is None:
            raise PerplexityError(f"C4 not found: expected {root / 'c4' / 'c4-validation*.json.gz'} (or .jsonl)")
        return Corpus(name, str(found), _json_texts(found))
    path = Path(name).expanduser()
    if not path.is_file():
        raise PerplexityError(f"perplexity file {path} {missing(path)}")
    stem = path.name
    if stem.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return Corpus(name, str(path), _json_texts(path))  # named as given: two doc.txt stay two tasks
    text = read_text(path)
    if not text.strip():
        raise PerplexityError(f"perplexity file {path} is empty")
    return Corpus(name, str(path), [text])


def _hub_wikitext() -> list[str]:
    from nvllm.models import hub

    if hub.hub_offline() or not hub.hub_reachable():
        raise PerplexityError("the Hugging Face hub is unreachable: pass --data-dir DIR holding "
                              "wikitext-2-raw/wiki.test.raw")
    import datasets  # pragma: no cover - needs the hub

    try:  # pragma: no cover
        ds = datasets.load_dataset("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1", split="test")
    except Exception as e:  # pragma: no cover
        raise PerplexityError(f"cannot load WikiText-2 from the hub: {e}") from e
    return list(ds["page"])  # pragma: no cover


def evaluate_perplexity(lm, corpus: Corpus, limit: int | None = None) -> dict:
    """Score the corpus (its first `limit` documents) with an NvllmLM; metrics plus per-document numbers."""
    raw, scored = corpus.raw[:limit], corpus.scored[:limit]
    tokens = [lm.tok_encode(text) for text in scored]  # as loglikelihood_rolling: the same numbers as lm-eval's
    per_doc = [lm.rolling_windows(t) for t in tokens]
    flat = [w for windows in per_doc for w in windows]
    scores = iter(lm.score_windows(flat, f"{corpus.name} perplexity"))
    logliks = [sum(next(scores)[0] for _ in windows) for windows in per_doc]
    n_tokens = [len(t) for t in tokens]
    n_words = [len(re.split(r"\s+", p)) for p in raw]
    n_bytes = [len(p.encode("utf-8")) for p in raw]
    return {"metrics": perplexity_metrics(logliks, n_tokens, n_words, n_bytes),
            "n_samples": len(raw), "n_tokens": sum(n_tokens), "source": corpus.source,
            "per_doc": {"loglikelihood": logliks, "tokens": n_tokens, "words": n_words, "bytes": n_bytes}}


def perplexity_metrics(logliks: list[float], tokens: list[int], words: list[int], bytes_: list[int]) -> dict:
    ll = sum(logliks)
    if sum(tokens) == 0:
        raise PerplexityError("no tokens to score")
    return {"token_perplexity": _exp(-ll / sum(tokens)), "word_perplexity": _exp(-ll / sum(words)),
            "byte_perplexity": _exp(-ll / sum(bytes_)), "bits_per_byte": -ll / sum(bytes_) / math.log(2)}


def _exp(x: float) -> float:
    """exp(x), inf beyond float range: a broken but finite model (huge logits) has a perplexity past 1.8e308."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
