"""Corpus, tokenizer and training windows for dyno-tiny: the Python standard library's own source."""

from __future__ import annotations

import ast
import hashlib
import json
import pathlib
import sys
import sysconfig
import unicodedata
from dataclasses import dataclass

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

# Held-out modules (paths relative to the stdlib root; a trailing "/" is a whole package). Never trained on.
HELD_OUT = (
    "calendar.py", "csv.py", "difflib.py", "fractions.py", "graphlib.py", "heapq.py",
    "ipaddress.py", "json/", "sched.py", "shlex.py", "statistics.py", "textwrap.py",
)
# Skipped entirely: test suites, third-party code, generated tables and data-like modules.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}
SKIP_FILES = ("_sysconfigdata", "this.py", "re/_casefix.py")

# Qwen's special tokens, appended after the BPE vocabulary as in Qwen releases (special=False ones are
# ordinary added tokens there too).
SPECIAL_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
RESERVED = 32  # slots after the BPE vocabulary: the specials above, the rest unused padding


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel: str) -> bool:
    return any(rel == h or (h.endswith("/") and rel.startswith(h)) for h in HELD_OUT)


def list_sources() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held_out) lists of (relative path, text), sorted by path; text is NFC (what the tokenizer sees)."""
    root = stdlib_root()
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if SKIP_DIRS.intersection(path.relative_to(root).parts) or rel.startswith(SKIP_FILES):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = unicodedata.normalize("NFC", text)
        (held if is_held_out(rel) else train).append((rel, text))
    return train, held


def corpus_fingerprint(files: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE in exactly the form transformers' Qwen3_5Tokenizer rebuilds (NFC, Qwen split regex,
    ByteLevel without its own regex), so tokenizer.json, transformers and mlx-lm all agree."""
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - RESERVED, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=s, normalized=False, single_word=False, lstrip=False, rstrip=False)
                    for t, s in SPECIAL_TOKENS])
    return tok


def chat_examples(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(user prompt, fenced code answer) pairs from top-level functions and classes of 3-60 lines."""
    out = []
    for rel, text in files:
        module = rel[:-3].replace("/__init__", "").replace("/", ".")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            n = node.end_lineno - start + 1
            if not 3 <= n <= 60:
                continue
            code = "\n".join(lines[start - 1 : node.end_lineno])
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            pick = int(hashlib.md5(f"{rel}:{node.name}".encode()).hexdigest(), 16) % 3
            prompt = (f"Write the Python {kind} `{node.name}` from the `{module}` module.",
                      f"Implement `{node.name}` in Python.",
                      f"Show me a Python {kind} named `{node.name}`.")[pick]
            out.append((prompt, f"```python\n{code}\n```"))
    return out


@dataclass
class TokenStream:
    """Documents tokenized and packed into one long stream, each followed by <|endoftext|>."""

    ids: torch.Tensor  # [N] int64

    @classmethod
    def build(cls, docs: list[str], tok: Tokenizer, eot: int) -> "TokenStream":
        ids: list[int] = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        return cls(torch.tensor(ids, dtype=torch.int64))

    def random_windows(self, gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
        """[batch, length] windows at uniformly random starts (seeded generator: deterministic)."""
        starts = torch.randint(0, len(self.ids) - length, (batch,), generator=gen)
        return torch.stack([self.ids[s : s + length] for s in starts.tolist()])

    def tiled_windows(self, count: int, length: int) -> torch.Tensor:
        """Up to `count` evenly spaced [length] windows covering the stream (deterministic eval set)."""
        n = len(self.ids) - length
        starts = torch.linspace(0, n, count).long().tolist() if n > 0 else [0]
        return torch.stack([self.ids[s : s + length] for s in starts])


def write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
