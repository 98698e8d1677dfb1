"""A tiny Mixtral-architecture language model trained on the Python standard library's source.

Recording and gating need a real MoE model with real router scores that runs on a CPU
without downloading anything: the machines have no network to any model hub. This module builds
one from nothing:

* :class:`ByteTokenizer` — a byte-level tokenizer (ids 0–255 are the bytes, then BOS, EOS, PAD),
  so no tokenizer file has to be fetched;
* :func:`tiny_config` — a ``transformers.MixtralConfig`` small enough (default hidden 96, 4
  layers, 8 experts, top-2) to train in minutes on one CPU thread;
* :func:`stdlib_corpus` — text that ships with Python itself (the ``.py`` files under
  ``sysconfig.get_paths()["stdlib"]``), split deterministically **by file** into a training and a
  held-out part (a file is held out when the first byte of SHA-256 of its relative path is < 26,
  about 10 %);
* :func:`train_tiny` — a seeded training loop (AdamW, cosine schedule, Mixtral's load-balancing
  auxiliary loss) with a wall-clock budget, saved with ``save_pretrained`` plus the tokenizer and a
  ``hdamoe_training.json`` record;
* loading a saved model directory (local files only): :func:`traces.capture.record.load_model`.

Weights are never committed: the default output directory is ``~/.cache/hdamoe-env/tiny-mixtral``.

Import layers (style.md §2): ``traces`` is the bottom layer; torch and transformers are imported
inside the functions that need them, never at module level.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "DEFAULT_MODEL_DIR",
    "ByteTokenizer",
    "Corpus",
    "TinyModelSpec",
    "TrainResult",
    "import_torch_transformers",
    "stdlib_corpus",
    "tiny_config",
    "train_tiny",
]

#: Default output directory of ``hdamoe traces train-tiny`` (outside every repository).
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "hdamoe-env" / "tiny-mixtral"

_TOKENIZER_FILE = "hdamoe_byte_tokenizer.json"
_TRAINING_FILE = "hdamoe_training.json"
_HELDOUT_THRESHOLD = 26          # first SHA-256 byte < 26 of 256: ≈ 10 % of the files held out


class RecordDependencyError(ImportError):
    """torch or transformers (the ``record`` extra) is not installed.

    ``hdamoe_env.app.cli`` turns it into the package's ``DependencyNotInstalled``; it is defined here
    because ``traces`` may not import the core (style.md §2).
    """


def import_torch_transformers() -> tuple[Any, Any]:
    """Import torch and transformers lazily, offline, with one torch thread.

    Sets ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` (unless the caller set them) so that
    nothing ever tries to reach a model hub.

    Returns:
        ``(torch, transformers)``.

    Raises:
        RecordDependencyError: One of them is missing; the message names the extra to install.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise RecordDependencyError(
            f"recording and gating real models needs torch and transformers ({exc}); install "
            "the extra: pip install -c constraints.txt -e '.[record]'") from exc
    transformers.utils.logging.disable_progress_bar()
    return torch, transformers


# ---------------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Byte-level tokenizer: ids 0–255 are the UTF-8 bytes, then BOS, EOS and PAD.

    Attributes:
        bos_id: Id prepended to every encoded text (256).
        eos_id: End-of-sequence id (257).
        pad_id: Padding id (258).
    """

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def vocab_size(self) -> int:
        """Number of ids (259)."""
        return 259

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Return the ids of ``text`` (UTF-8 bytes), with BOS first unless ``add_bos`` is false."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Any) -> str:
        """Return the text of ``ids``; special ids are dropped, invalid UTF-8 is replaced."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the tokenizer description next to a saved model; return the file path."""
        path = Path(directory) / _TOKENIZER_FILE
        path.write_text(json.dumps({"kind": "hdamoe-byte", **asdict(self)}, indent=1))
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ByteTokenizer:
        """Read the tokenizer of a saved model directory (defaults when the file is absent)."""
        path = Path(directory) / _TOKENIZER_FILE
        if not path.is_file():
            return cls()
        data = json.loads(path.read_text())
        data.pop("kind", None)
        return cls(**data)


# ---------------------------------------------------------------------------------- model spec


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the tiny Mixtral model.

    Attributes:
        hidden_size: h.
        intermediate_size: I of one expert.
        num_layers: Decoder layers (every one is an MoE layer).
        num_heads: Attention heads.
        num_kv_heads: Key/value heads (grouped-query attention).
        num_experts: E.
        top_k: k.
        max_positions: Longest sequence the model is trained and used on.
        router_aux_loss_coef: Weight of Mixtral's load-balancing loss during training.
    """

    hidden_size: int = 96
    intermediate_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    max_positions: int = 512
    router_aux_loss_coef: float = 0.02

    def __post_init__(self) -> None:
        """Check that the sizes are positive and consistent."""
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "num_experts", "top_k", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyModelSpec.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"TinyModelSpec.top_k={self.top_k} exceeds num_experts="
                             f"{self.num_experts}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must be divisible by num_heads and num_heads by "
                             f"num_kv_heads, got {self.hidden_size}, {self.num_heads}, "
                             f"{self.num_kv_heads}")


def tiny_config(spec: TinyModelSpec | None = None, tokenizer: ByteTokenizer | None = None) -> Any:
    """Return a ``transformers.MixtralConfig`` for the tiny model.

    Args:
        spec: Model shape (default :class:`TinyModelSpec`).
        tokenizer: Byte tokenizer whose special ids the config records.

    Returns:
        The config (``transformers`` is imported lazily).
    """
    _, transformers = import_torch_transformers()
    spec = spec or TinyModelSpec()
    tok = tokenizer or ByteTokenizer()
    return transformers.MixtralConfig(
        vocab_size=tok.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions, num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k, router_aux_loss_coef=spec.router_aux_loss_coef,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        tie_word_embeddings=True, use_cache=True)


# ---------------------------------------------------------------------------------- corpus


@dataclass(frozen=True, eq=False)
class Corpus:
    """Byte tokens of the stdlib sources, split by file.

    Attributes:
        train: uint8 [N_train] concatenated training files (each preceded by a newline).
        heldout_files: Relative paths of the held-out files, sorted.
        heldout_texts: Their texts, in the same order.
        root: The stdlib directory.
        train_files: Number of training files.
    """

    train: NDArray[np.uint8]
    heldout_files: tuple[str, ...]
    heldout_texts: tuple[str, ...]
    root: str
    train_files: int


def is_heldout(relative_path: str) -> bool:
    """Return whether a stdlib file (path relative to the stdlib root) belongs to the held-out part."""
    return hashlib.sha256(relative_path.encode()).digest()[0] < _HELDOUT_THRESHOLD


def stdlib_corpus(max_train_bytes: int = 16_000_000, max_file_bytes: int = 200_000) -> Corpus:
    """Collect the Python standard library's ``.py`` sources, split deterministically by file.

    Files under ``site-packages``, ``test``/``tests``, ``idlelib`` and ``__pycache__`` are skipped;
    the remaining files are sorted by relative path, and a file is held out when the first byte of
    SHA-256 of its relative path is below 26 (≈ 10 %). Training files are concatenated until
    ``max_train_bytes``.

    Args:
        max_train_bytes: Cap on the training bytes.
        max_file_bytes: Files larger than this are skipped (generated tables).

    Returns:
        The corpus.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__", "dist-packages"}
    files = sorted(p for p in root.rglob("*.py")
                   if not skip.intersection(p.relative_to(root).parts))
    train_chunks: list[bytes] = []
    total = 0
    held_names: list[str] = []
    held_texts: list[str] = []
    n_train = 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data or len(data) > max_file_bytes:
            continue
        if is_heldout(rel):
            held_names.append(rel)
            held_texts.append(data.decode("utf-8", errors="replace"))
        elif total < max_train_bytes:
            train_chunks.append(b"\n" + data)
            total += len(data) + 1
            n_train += 1
    train = np.frombuffer(b"".join(train_chunks)[:max_train_bytes], dtype=np.uint8).copy()
    return Corpus(train, tuple(held_names), tuple(held_texts), str(root), n_train)


# ---------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainResult:
    """Outcome of :func:`train_tiny`.

    Attributes:
        out_dir: Where the model was saved.
        steps: Optimiser steps done.
        tokens: Training tokens seen.
        wall_s: Wall time of the training loop (seconds, excluding corpus loading and saving).
        train_loss: Mean cross-entropy (nats/byte) of the last 20 steps.
        heldout_loss: Cross-entropy on held-out windows (nats/byte).
        heldout_bpb: Held-out bits per byte.
        seed: Seed used.
    """

    out_dir: str
    steps: int
    tokens: int
    wall_s: float
    train_loss: float
    heldout_loss: float
    heldout_bpb: float
    seed: int


def _heldout_windows(corpus: Corpus, tokenizer: ByteTokenizer, seq_len: int, count: int
                     ) -> NDArray[np.int64]:
    """Return the first ``count`` non-overlapping BOS-led windows of the held-out files."""
    rows: list[list[int]] = []
    for text in corpus.heldout_texts:
        ids = tokenizer.encode(text, add_bos=False)
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            rows.append([tokenizer.bos_id, *ids[start:start + seq_len - 1]])
            if len(rows) >= count:
                return np.asarray(rows, dtype=np.int64)
    return np.asarray(rows, dtype=np.int64).reshape(-1, seq_len)


def train_tiny(out_dir: str | os.PathLike[str] = DEFAULT_MODEL_DIR, *, minutes: float = 8.0,
               seed: int = 0, spec: TinyModelSpec | None = None, seq_len: int = 128,
               batch_size: int = 16, lr: float = 3e-3, max_steps: int | None = None,
               log_every: int = 50, log: Any = print) -> TrainResult:
    """Train the tiny Mixtral model on stdlib sources for a wall-clock budget and save it.

    One ``torch.Generator`` seeded with ``seed`` draws the initial weights' randomness (through
    ``torch.manual_seed`` of a forked RNG state) and every training window; torch runs on one
    thread. The learning rate follows a linear warm-up (50 steps) and a cosine decay over the
    expected number of steps (re-estimated from the measured step time after 20 steps).

    Args:
        out_dir: Output directory (created); ``save_pretrained`` + tokenizer + training record.
        minutes: Wall-clock budget of the training loop.
        seed: Seed of the initialisation and of the data order.
        spec: Model shape.
        seq_len: Training window length (bytes, BOS included).
        batch_size: Windows per step.
        lr: Peak learning rate of AdamW.
        max_steps: Optional cap on the steps (tests).
        log_every: Log the loss every this many steps.
        log: Callable receiving progress lines.

    Returns:
        The training record (also written to ``hdamoe_training.json``).
    """
    torch, transformers = import_torch_transformers()
    torch.set_num_threads(1)
    spec = spec or TinyModelSpec()
    tok = ByteTokenizer()
    corpus = stdlib_corpus()
    log(f"corpus: {corpus.train_files} training files, {corpus.train.size:,} bytes; "
        f"{len(corpus.heldout_files)} held-out files ({corpus.root})")
    config = tiny_config(spec, tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.MixtralForCausalLM(config)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(corpus.train.astype(np.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = minutes * 60.0
    warmup = 50
    expected = max_steps or 10_000
    losses: list[float] = []
    step = 0
    t0 = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - t0
        if (max_steps is not None and step >= max_steps) or elapsed >= budget:
            break
        if step == 20 and max_steps is None:
            expected = max(warmup + 1, int(budget / (elapsed / 20)))
        frac = min(1.0, max(0.0, (step - warmup) / max(1, expected - warmup)))
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(
            math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=gen)
        body = torch.stack([data[s:s + seq_len - 1] for s in starts.tolist()])
        batch = torch.cat([torch.full((batch_size, 1), tok.bos_id), body], dim=1)
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        aux = 0.0 if out.aux_loss is None else float(out.aux_loss.detach())
        lm_loss = float(loss.detach()) - spec.router_aux_loss_coef * aux
        losses.append(lm_loss)
        step += 1
        if log_every and step % log_every == 0:
            log(f"step {step} ({time.perf_counter() - t0:.0f} s): loss {lm_loss:.3f} nats/byte, "
                f"lr {lr * scale:.2e}")
    wall = time.perf_counter() - t0
    model.eval()
    windows = _heldout_windows(corpus, tok, seq_len, 64)
    with torch.no_grad():
        total = 0.0
        for chunk in np.array_split(windows, max(1, len(windows) // 16)):
            batch = torch.from_numpy(chunk)
            total += float(model(input_ids=batch, labels=batch).loss) * len(chunk)
        heldout = total / max(1, len(windows))
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tok.save(target)
    result = TrainResult(str(target), step, step * batch_size * seq_len, wall,
                         float(np.mean(losses[-20:])) if losses else float("nan"), heldout,
                         heldout / math.log(2), seed)
    record = {**asdict(result), "spec": asdict(spec), "seq_len": seq_len,
              "batch_size": batch_size, "lr": lr, "corpus_root": corpus.root,
              "train_files": corpus.train_files, "train_bytes": int(corpus.train.size),
              "heldout_files": len(corpus.heldout_files),
              "torch": torch.__version__, "transformers": transformers.__version__}
    (target / _TRAINING_FILE).write_text(json.dumps(record, indent=1))
    log(f"saved {target}: {step} steps in {wall:.0f} s, held-out {heldout:.3f} nats/byte "
        f"({heldout / math.log(2):.3f} bits/byte)")
    return result
