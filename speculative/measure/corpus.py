"""The text a head is tuned or evaluated on: a plain text file (one document) or JSONL, one object per
line with `text` (a document), `prompt` (a prompt the model continues) or `messages` (a chat, continued
after its chat template's generation prompt)."""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from ..errors import DynoError


@dataclass
class Corpus:
    """Token ids of the documents and of the prompts in a data file, and a digest of its bytes."""

    path: Path
    sha256: str
    documents: List[List[int]] = field(default_factory=list)
    prompts: List[List[int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.documents)) + sum(map(len, self.prompts))


def read_corpus(path, tokenizer) -> Corpus:
    """Read and tokenize `path`; an unreadable, empty or malformed file is one DynoError line."""
    path = Path(path).expanduser()
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except OSError as e:
        raise DynoError(f"cannot read the data file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DynoError(f"the data file {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    corpus = Corpus(path, hashlib.sha256(raw).hexdigest())
    if path.suffix.lower() in (".jsonl", ".json"):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                _add_record(corpus, line, n, tokenizer)
    elif text.strip():
        corpus.documents.append(tokenizer.encode(text))
    if not any(corpus.documents) and not any(corpus.prompts):
        raise DynoError(f"the data file {path} holds no text")
    return corpus


def _add_record(corpus: Corpus, line: str, n: int, tokenizer) -> None:
    where = f"{corpus.path} line {n}"
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DynoError(f"{where} is not JSON: {e}") from None
    if isinstance(record, str):
        record = {"text": record}
    if not isinstance(record, dict):
        raise DynoError(f"{where} is not a JSON object or string")
    if isinstance(record.get("text"), str):
        corpus.documents.append(tokenizer.encode(record["text"]))
    elif isinstance(record.get("prompt"), str):
        corpus.prompts.append(tokenizer.encode(record["prompt"]))
    elif isinstance(record.get("messages"), list):
        try:
            ids = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template rejecting the messages: the line's fault, said in one line
            raise DynoError(f"{where}: the chat template rejects its messages ({type(e).__name__}: {e})") from None
        corpus.prompts.append(list(ids))
    else:
        raise DynoError(f"{where} has no \"text\", \"prompt\" or \"messages\"")


def eval_prompts(corpus: Corpus, count: int, length: int) -> List[List[int]]:
    """Up to `count` prompts: the corpus's prompts first, then openings of `length` tokens cut from its
    documents, spread evenly through them (the model writes what follows each)."""
    prompts = [p for p in corpus.prompts if p][:count]
    stream = [t for doc in corpus.documents for t in doc]
    need = count - len(prompts)
    if need > 0 and len(stream) >= length:
        starts = sorted({round(i * (len(stream) - length) / max(1, need - 1)) for i in range(need)})
        prompts += [stream[s : s + length] for s in starts]
    if not prompts:
        raise DynoError(f"the data file {corpus.path} has no prompt and no document of {length} tokens")
    return prompts
