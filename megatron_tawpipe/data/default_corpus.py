"""The embedded default corpus, built on the spot without any network access.

The text is real English prose every Python installation already has: the docstrings of
the Python standard library (modules, classes, functions; read with ``ast``, never
imported) plus the help topics of ``pydoc_data`` (the language reference text that
``help()`` shows).  From it we train a SentencePiece tokenizer and write Megatron
``.bin``/``.idx`` files:

    <out>/corpus.jsonl                    one JSON document per stdlib module / help topic
    <out>/tokenizer.model (+ .vocab)      SentencePiece BPE model
    <out>/corpus_text_document.bin/.idx   the tokenized corpus (Megatron indexed dataset)
    <out>/manifest.json                   settings and sizes; outputs are reused while it matches

Every step is skipped when its output exists and the manifest matches the settings, so a
second call costs almost nothing.  The order of files, docstrings and documents is fixed
(sorted paths, source order, first occurrence wins), so one Python version always gives
the same corpus.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

from megatron_tawpipe.common.atomic import atomic_write, atomic_write_json

DEFAULT_OUTPUT_DIR = os.path.join("data", "default")
DEFAULT_VOCAB_SIZE = 8000
DEFAULT_SEED = 1234
CORPUS_VERSION = 1

# Directory names under the stdlib that are not the standard library itself.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "lib-dynload", "config"}


@dataclass
class DefaultCorpus:
    """Paths of the built default corpus."""

    output_dir: str
    jsonl: str
    tokenizer_model: str
    data_prefix: str
    num_documents: int
    num_chars: int
    num_tokens: int

    def flags(self) -> List[str]:
        """The pretrain_llama.py flags that select this corpus."""
        return [
            "--data-path", self.data_prefix,
            "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", self.tokenizer_model,
        ]


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _stdlib_files(root: str) -> List[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(files)


def _docstrings_of_file(args: Tuple[str, str]) -> Tuple[str, List[str]]:
    """(module name, docstrings in source order) of one stdlib file; unparsable files give []."""
    root, rel = args
    module = rel[:-3].replace(os.sep, ".")
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
    try:
        with open(os.path.join(root, rel), "rb") as f:
            tree = ast.parse(f.read(), filename=rel)
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return module, []
    docs: List[str] = []

    def visit(node):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                docs.append(doc.strip())
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return module, docs


def _pydoc_topics(root: str) -> List[Tuple[str, str]]:
    """(topic, text) pairs of pydoc_data/topics.py, read as a literal (not imported)."""
    path = os.path.join(root, "pydoc_data", "topics.py")
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            try:
                topics = ast.literal_eval(node.value)
            except ValueError:
                continue
            return [(k, v.strip()) for k, v in sorted(topics.items())
                    if isinstance(k, str) and isinstance(v, str) and v.strip()]
    return []


def iter_stdlib_documents(root: Optional[str] = None, workers: int = 1) -> Iterator[dict]:
    """Documents {"text", "source"}: one per stdlib module (its unique docstrings joined by
    blank lines) and one per pydoc help topic, in a fixed order."""
    root = root or stdlib_dir()
    files = _stdlib_files(root)
    jobs = [(root, rel) for rel in files]
    if workers > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_docstrings_of_file, jobs, chunksize=16)
    else:
        results = map(_docstrings_of_file, jobs)
    seen = set()
    for module, docs in results:
        unique = []
        for doc in docs:
            if doc not in seen:
                seen.add(doc)
                unique.append(doc)
        if unique:
            yield {"text": "\n\n".join(unique), "source": f"stdlib:{module}"}
    for topic, text in _pydoc_topics(root):
        if text not in seen:
            seen.add(text)
            yield {"text": text, "source": f"pydoc:{topic}"}


def _atomic_write_jsonl(path: str, docs) -> Tuple[int, int]:
    ndocs = nchars = 0
    with atomic_write(path) as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            ndocs += 1
            nchars += len(doc["text"])
    return ndocs, nchars


def _save_manifest(path: str, manifest: dict) -> None:
    atomic_write_json(path, manifest, indent=2, sort_keys=True)


def _read_texts(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def build_default_corpus(output_dir: str = DEFAULT_OUTPUT_DIR, vocab_size: int = DEFAULT_VOCAB_SIZE,
                         seed: int = DEFAULT_SEED, workers: Optional[int] = None,
                         force: bool = False, source_root: Optional[str] = None,
                         log: Callable[[str], None] = print) -> DefaultCorpus:
    """Build (or reuse) the default corpus under ``output_dir`` and return its paths.

    Steps, each skipped when its output exists and ``manifest.json`` matches:
    gather stdlib docstrings -> ``corpus.jsonl``; train SentencePiece -> ``tokenizer.model``;
    tokenize -> ``corpus_text_document.bin/.idx``.  ``source_root`` replaces the
    standard library directory as the source of text (for tests).
    """
    from megatron_tawpipe import data

    workers = workers or min(4, os.cpu_count() or 1)
    source_root = os.path.abspath(source_root or stdlib_dir())
    os.makedirs(output_dir, exist_ok=True)
    jsonl = os.path.join(output_dir, "corpus.jsonl")
    model_prefix = os.path.join(output_dir, "tokenizer")
    model = model_prefix + ".model"
    data_prefix = data.indexed_dataset_path(os.path.join(output_dir, "corpus"), "text")
    manifest_path = os.path.join(output_dir, "manifest.json")
    settings = {
        "corpus_version": CORPUS_VERSION,
        "python": "%d.%d.%d" % sys.version_info[:3],
        "vocab_size": int(vocab_size),
        "model_type": "bpe",
        "seed": int(seed),
        "source_root": source_root,
    }
    manifest = {}
    if os.path.isfile(manifest_path) and not force:
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            manifest = {}
    if manifest.get("settings") != settings or force:
        for path in (jsonl, model, model_prefix + ".vocab", data_prefix + ".bin",
                     data_prefix + ".idx", manifest_path):
            if os.path.exists(path):
                os.remove(path)
        manifest = {"settings": settings}
        _save_manifest(manifest_path, manifest)

    t0 = time.time()
    if not os.path.isfile(jsonl):
        t = time.time()
        ndocs, nchars = _atomic_write_jsonl(jsonl, iter_stdlib_documents(source_root, workers=workers))
        if ndocs == 0:
            os.remove(jsonl)
            raise RuntimeError(f"found no docstrings in the Python files under {source_root}")
        manifest.update(num_documents=ndocs, num_chars=nchars)
        log(f"default corpus: {ndocs} documents, {nchars / 1e6:.2f} M characters from "
            f"{source_root} -> {jsonl} ({time.time() - t:.1f} s)")
        for path in (model, data_prefix + ".bin", data_prefix + ".idx"):
            if os.path.exists(path):
                os.remove(path)
    elif "num_documents" not in manifest:
        ndocs = nchars = 0
        for text in _read_texts(jsonl):
            ndocs += 1
            nchars += len(text)
        manifest.update(num_documents=ndocs, num_chars=nchars)

    if not os.path.isfile(model):
        t = time.time()
        # One thread: the model file records the thread count, and this keeps it
        # byte-identical whatever --workers is (training takes about a second anyway).
        data.train_sentencepiece(_read_texts(jsonl), model_prefix, vocab_size, model_type="bpe",
                                 seed=seed, num_threads=1)
        log(f"default corpus: trained SentencePiece BPE tokenizer, vocab {vocab_size} -> {model} "
            f"({time.time() - t:.1f} s)")
        for path in (data_prefix + ".bin", data_prefix + ".idx"):
            if os.path.exists(path):
                os.remove(path)

    if not (os.path.isfile(data_prefix + ".bin") and os.path.isfile(data_prefix + ".idx")):
        t = time.time()
        # megatron-core caches sample indices under <prefix>/cache/ keyed by settings, not by
        # file contents: drop them with the data they were built for.
        if os.path.isdir(data_prefix):
            import shutil

            shutil.rmtree(data_prefix)
        data.write_indexed_dataset(
            ({"text": text} for text in _read_texts(jsonl)),
            os.path.join(output_dir, "corpus"),
            "SentencePieceTokenizer", tokenizer_model=model, append_eod=True,
            workers=workers, log=lambda msg: log(f"default corpus: {msg} ({time.time() - t:.1f} s)"),
        )

    if "num_tokens" not in manifest:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(data_prefix)
        manifest["num_tokens"] = int(ds.sequence_lengths.sum())
        del ds
        manifest["files"] = {os.path.basename(p): os.path.getsize(p) for p in
                             (jsonl, model, data_prefix + ".bin", data_prefix + ".idx")}
        _save_manifest(manifest_path, manifest)
        log(f"default corpus ready in {time.time() - t0:.1f} s")

    return DefaultCorpus(
        output_dir=output_dir,
        jsonl=jsonl,
        tokenizer_model=model,
        data_prefix=data_prefix,
        num_documents=int(manifest["num_documents"]),
        num_chars=int(manifest["num_chars"]),
        num_tokens=int(manifest["num_tokens"]),
    )
